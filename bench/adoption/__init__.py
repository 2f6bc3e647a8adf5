"""What a newcomer and an adopter meet first: the first make demo on a fresh clone."""
