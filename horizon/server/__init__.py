"""OpenAI- and Anthropic-compatible serving: thin API adapters over one ModelService seam."""

from horizon.server.app import ServerSettings, create_app
from horizon.server.service import Conversation, ModelService, ServiceError

__all__ = ["Conversation", "ModelService", "ServerSettings", "ServiceError", "create_app"]
