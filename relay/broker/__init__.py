"""The store behind the edge: what the edge needs of it (base.py) and two of them."""
