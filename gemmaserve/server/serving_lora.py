"""LoRA adapters over HTTP: listed in /v1/models beside their base, named by a request's `model`, and loaded or
unloaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter, behind the API key) from directories
under --lora-root only: a path outside it, a link that leads out of it or a URL is refused."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..errors import UserInputError
from .protocol import ApiError, LoadLoRARequest, UnloadLoRARequest, parse
from .serving import ServingCommon


class LoRAServing:
    """Holds the shared request plumbing (`ServingCommon`) and, through it, the engine's client."""

    def __init__(self, common: ServingCommon):
        self.common, self.client, self.model = common, common.client, common.model

    def lora_models(self, created: int) -> list[dict]:
        """The adapters as /v1/models lists them (after the base model)."""
        return [{"id": ref.name, "object": "model", "created": created, "owned_by": "gemmaserve", "root": ref.path,
                 "parent": self.model.name, "max_model_len": self.client.info.max_model_len}
                for ref in self.client.adapter_refs()]

    def _adapter_dir(self, given: str) -> str:
        root = self.common.config.lora_root
        if root is None:
            raise ApiError(403, "loading LoRA adapters at run time is off: start the server with --lora-root DIR",
                           param="lora_path", code="lora_loading_disabled")
        if "://" in given:
            raise ApiError(400, "lora_path must be a directory under --lora-root, not a URL", param="lora_path")
        try:
            base = Path(root).resolve()
            path = (base / given).resolve()   # relative to the root, or absolute; links resolved before the check
        except (OSError, ValueError) as exc:
            raise ApiError(400, f"lora_path {given!r} is not a usable path: {exc}", param="lora_path") from None
        if path != base and base not in path.parents:
            raise ApiError(403, f"lora_path {given!r} is outside --lora-root", param="lora_path",
                           code="lora_path_forbidden")
        return str(path)

    async def load_lora_adapter(self, request: Request) -> Response:
        req: LoadLoRARequest = parse(LoadLoRARequest, await self.common.read_json(request))
        if req.lora_name in self.model.accepted_names:
            raise ApiError(400, f"{req.lora_name!r} is the base model's name", param="lora_name")
        path = self._adapter_dir(req.lora_path)
        try:
            await self.common.engine_call(self.client.add_adapter(req.lora_name, path))
        except UserInputError as exc:
            raise ApiError(400, str(exc), param="lora_path") from None
        return JSONResponse({"object": "lora_adapter", "id": req.lora_name, "status": "loaded"})

    async def unload_lora_adapter(self, request: Request) -> Response:
        req: UnloadLoRARequest = parse(UnloadLoRARequest, await self.common.read_json(request))
        if not self.client.has_adapter(req.lora_name):
            raise ApiError(404, f"no LoRA adapter named {req.lora_name!r} is loaded", param="lora_name",
                           code="model_not_found")
        try:
            await self.common.engine_call(self.client.remove_adapter(req.lora_name))
        except UserInputError as exc:   # in use by unfinished requests (or removed meanwhile)
            raise ApiError(409, str(exc), param="lora_name", code="lora_in_use") from None
        return JSONResponse({"object": "lora_adapter", "id": req.lora_name, "status": "unloaded"})
