"""What a client can make the cluster store: the hostile storage benchmark."""
