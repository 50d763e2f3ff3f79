"""The models the router serves, from the registry to the running ServedModel.

The registry and their settings, pulling, starting and stopping them through the launcher's
model host, their limits, and ServedModel, the one running model as the APIs see it.
"""
