"""The models the router serves: the registry, their settings, starting and stopping them through
the launcher's model host, and ServedModel, the one running model as the APIs see it."""
