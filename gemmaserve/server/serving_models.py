"""GET /v1/models: the served model, and the LoRA adapters beside it (serving_lora.py lists them)."""

from __future__ import annotations

from .serving import ServingCommon
from .serving_lora import LoRAServing


class ModelsServing:
    def __init__(self, common: ServingCommon, adapters: LoRAServing, created: int):
        """`created`: when the server started (what every model entry says)."""
        self.common, self.adapters, self.created = common, adapters, created

    async def models(self) -> dict:
        info = self.common.client.info
        return {"object": "list", "data": [{"id": self.common.model.name, "object": "model", "created": self.created,
                                            "owned_by": "gemmaserve", "root": info.model,
                                            "max_model_len": info.max_model_len},
                                           *self.adapters.lora_models(self.created)]}
