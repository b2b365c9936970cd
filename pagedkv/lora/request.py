"""What a caller gives to run a request under an adapter (vLLM's ``LoRARequest``). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import PagedKVError


class LoRAError(PagedKVError, ValueError):
    """An adapter cannot be used: unknown, unreadable, or not applicable to this base model
    (the message names the field or file at fault). ``status`` is the HTTP status the server
    answers with: 404 for an unknown adapter, else 400."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name and folder: ``LoRARequest("sql", 1, "/adapters/sql")``.

    ``lora_name`` identifies it to callers (the server's ``model`` field); ``lora_int_id`` is
    vLLM's integer id (the KV events' ``lora_id``); ``lora_path`` is a PEFT folder
    (``adapter_config.json`` + ``adapter_model.safetensors``). The prefix cache keys blocks by the
    name and a digest of the weights, never by the id alone, so a folder whose weights changed is
    never served another version's KV.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be an integer >= 1 (vLLM's rule), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRAError(f"lora_path must be the adapter's folder, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
