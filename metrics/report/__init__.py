"""What the agent reports: Prometheus exposition, NodeMetric status and its reporter."""
