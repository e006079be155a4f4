"""gymproxy: an aiohttp proxy that serves the Responses API in front of vLLM's Chat Completions."""

__version__ = "0.1.0"

from .config import Config, ConfigError, build_config, load_config  # noqa: E402
from .plugin import create_app, setup  # noqa: E402

__all__ = ("Config", "ConfigError", "build_config", "create_app", "load_config", "setup", "__version__")
