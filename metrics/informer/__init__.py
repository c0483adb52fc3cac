"""What the agent knows of the node and its pods: states informer, API client, pod views."""
