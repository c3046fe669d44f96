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
loop: a request's `model` is checked against it without asking the engine thread. Each load and
unload brings back the engine's names as they stand right after it (`_on_engine`), and the list
follows them: two calls on one name in flight at once (a load in place and an unload) end with
the list the engine has, whichever call's answer comes back last.
"""

from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from common.errors import UserError
from errors import APIError
from lora_slots import MAX_NAME_CHARS, AdapterNameError, NoAdapterSlots

router = APIRouter()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_path: str = Field(min_length=1)
    load_inplace: StrictBool = False  # vLLM's: a loaded name takes the new weights instead of a 400 ("yes" is no bool)


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
        await _on_engine(
            state, lambda adapters: adapters.register(name, body.lora_path, replace=replace), name, body.lora_path
        )
    except UserError as e:  # the field at fault: the name, the path, or neither (a server with no slots)
        field = "lora_name" if isinstance(e, AdapterNameError) else "lora_path"
        raise APIError(400, str(e), param=None if isinstance(e, NoAdapterSlots) else field) from None
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
        await _on_engine(state, lambda adapters: adapters.unregister(name))
    except UserError as e:
        raise APIError(404, str(e), param="lora_name") from None
    return f"Success: LoRA adapter '{name}' removed successfully."


async def _on_engine(state, change, name: str | None = None, path: str | None = None) -> None:
    """change(engine.adapters) on the engine thread, between two steps; then the server's list
    (name -> its folder) becomes the engine's names as they were right after it (`name` at `path`,
    when the change loaded it)."""

    def change_then_names(engine) -> list[str]:
        change(engine.adapters)
        return engine.adapters.names()

    names = await state.worker.call(change_then_names)
    known = state.adapters | ({name: path} if name is not None else {})
    state.adapters = {n: known.get(n) for n in names}
