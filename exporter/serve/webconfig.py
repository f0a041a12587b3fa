"""The listener's web configuration (exporter-toolkit's file format). Its schema lives with the
rest of the configuration, in exporter/config/web.py, so `check-config` checks it as `run` does."""
from ..config.web import WebConfig, load_web_config, ssl_context

__all__ = ["WebConfig", "load_web_config", "ssl_context"]
