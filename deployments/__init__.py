"""Ray Serve deployments and Ray actors: thin wrappers over engine objects."""
