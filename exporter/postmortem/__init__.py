"""After an incident: recorded traces, Prometheus ranges, offline replay, reports and log explanations."""
