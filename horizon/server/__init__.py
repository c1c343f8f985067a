"""OpenAI- and Anthropic-compatible serving over HTTP: thin API adapters over the `horizon.serving` seam."""

from horizon.server.app import ServerSettings, create_app, read_keys_file
from horizon.serving import Conversation, ModelService, ServiceError

__all__ = ["Conversation", "ModelService", "ServerSettings", "ServiceError", "create_app", "read_keys_file"]
