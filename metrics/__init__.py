"""Collectors, the time-series store, states informer, QoS manager and reporters."""
