"""The HTTP side of LoRA serving: vLLM's routes to load and unload adapters while the server runs.

    POST /v1/load_lora_adapter    {"lora_name": "pirate", "lora_path": "/path/to/peft/dir"}
    POST /v1/load_lora_adapter    {"lora_name": "pirate", "lora_path": "...", "load_inplace": true}
    POST /v1/unload_lora_adapter  {"lora_name": "pirate"}

Both answer 200 with a line of text, as vLLM does; a bad adapter (missing or corrupt files, wrong
shapes, a rank over --max-lora-rank, a name in use) is a 400, an unknown name to unload a 404.
The engine reads and checks the adapter on its own thread between two steps (worker.call), so a
load never races a step that reads the slot table. After an unload no new request may name the
adapter; requests already running keep it to their end (lora_slots.py). `load_inplace` gives a
loaded name new weights the same way: new requests get them at once, running ones keep the old.

The server keeps its own list of names (ServerState.adapters), changed only here on the event
loop: a request's `model` is checked against it without asking the engine thread.
"""

from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from common.errors import UserError
from errors import APIError
from lora_slots import AdapterNameError

router = APIRouter()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: a loaded name takes the new weights instead of a 400


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's clients may send it; names are what count here


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraRequest, http: HTTPRequest):
    state = http.app.state.server
    name = body.lora_name
    if name == state.model_name:
        raise APIError(400, f"'{name}' is the base model's name: give the adapter another", param="lora_name")
    replace = body.load_inplace
    if name in state.adapters and not replace:
        raise APIError(
            400, f"LoRA adapter '{name}' is already loaded; unload it first, or load it in place", param="lora_name"
        )
    try:
        await state.worker.call(lambda engine: engine.adapters.register(name, body.lora_path, replace=replace))
    except UserError as e:
        raise APIError(400, str(e), param="lora_name" if isinstance(e, AdapterNameError) else "lora_path") from None
    state.adapters[name] = body.lora_path
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraRequest, http: HTTPRequest):
    state = http.app.state.server
    name = body.lora_name
    if name not in state.adapters:
        loaded = ", ".join(state.adapters) or "none"
        raise APIError(404, f"no LoRA adapter named '{name}' is loaded (loaded: {loaded})", param="lora_name")
    del state.adapters[name]  # new requests naming it get a 404 from now on
    try:
        await state.worker.call(lambda engine: engine.adapters.unregister(name))
    except UserError as e:
        raise APIError(404, str(e), param="lora_name") from None
    return f"Success: LoRA adapter '{name}' removed successfully."
