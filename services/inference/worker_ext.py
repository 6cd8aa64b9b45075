"""vLLM worker extension: in-place reload of HF-named weights sent as safetensors bytes.

Mixed into every vLLM worker via ``worker_extension_cls``; called through
``AsyncLLM.collective_rpc("ludic_load_safetensors", args=(payload,))``. Bytes (not tensors
in lists) are what survives the RPC serialisation, and ``reload_weights`` (not a bare
``model.load_weights``) redoes the backend's weight post-processing, which the CPU backend
needs.
"""

from __future__ import annotations

from typing import Any


class LudicWorkerExtension:
    def ludic_load_safetensors(self, payload: Any) -> int:
        """Reload the tensors in ``payload`` (safetensors bytes); return how many."""
        from safetensors.torch import load

        tensors = load(bytes(payload))
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)
