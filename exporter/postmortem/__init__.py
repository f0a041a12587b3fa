"""After an incident, offline: recorded traces, Prometheus ranges, replay, reports and log
explanations. Nothing here runs on the daemon's tick (the live reactions are in reactions/)."""
