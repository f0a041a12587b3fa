"""What a scrape sees: the Prometheus exposition of the published State and the HTTP listener."""
