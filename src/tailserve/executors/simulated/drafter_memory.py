"""What a speculative drafter takes from the KV pool, one description for every engine.

An engine that runs its drafter on the GPU loads the drafter's weights before it sizes its KV
pool (so they come off the memory the pool is carved from) and gives the drafter's attention
layers KV for every token the target holds (so each token costs more). ``Policy.drafter_memory``
answers with a ``DrafterMemory`` in units of the target's own layers, and ``kv_capacity``
resolves it against the deployment (model, TP, data-parallel ranks):

- ``weight_layers``: decoder layers of the target's shape loaded beside it
  (``spec_decode.draft_layer_weight_bytes``: an MoE target's is one MoE layer; the embedding and
  LM head are the target's, shared). vLLM's and SGLang's EAGLE / EAGLE-3 / MTP drafters: one.
- ``kv_layers``: layers of the target's shape whose KV every token holds beside the target's.
- ``mtp_projection``: each weight layer also carries an MTP module's ``eh_proj`` (``2h -> h``,
  unquantized, row-parallel over TP: TensorRT-LLM's ``DeepseekV3MTP``); the ``enorm`` / ``hnorm``
  norms are left out (``2h`` values).

Assumptions (``docs/cost_model.md``, "Drafter memory"): the draft layer has the target's
shapes, so EAGLE-3's own ``fc`` (``3h -> h``) and draft-vocabulary LM head are not counted, and
a dense EAGLE-3 head for an MoE target is counted as an MoE layer (an overstatement).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.executors.simulated.model_spec import ModelSpec
from tailserve.executors.simulated.spec_decode import draft_layer_model, draft_layer_weight_bytes


@dataclass(frozen=True, slots=True)
class DrafterMemory:
    weight_layers: int  # decoder layers of the target's shape loaded beside it
    kv_layers: int  # layers of the target's shape whose KV each token holds beside the target's
    mtp_projection: bool = False  # each weight layer carries MTP's eh_proj (2h x h)
    source: str = ""  # where the engine loads the drafter and sizes its KV (file:line@version)

    def __post_init__(self) -> None:
        if self.weight_layers < 0:
            raise ValueError(f"weight_layers must be >= 0, got {self.weight_layers}")
        if self.kv_layers < 0:
            raise ValueError(f"kv_layers must be >= 0, got {self.kv_layers}")

    def weight_bytes(self, model: ModelSpec, tp: int, dp: int = 1) -> float:
        """The drafter's weights on one GPU (bytes)."""
        if not self.weight_layers:
            return 0.0
        per_layer = draft_layer_weight_bytes(model, tp, dp)
        if self.mtp_projection:
            # eh_proj is created without a quantization config: the model's activation dtype.
            per_layer += 2 * model.hidden_size * model.hidden_size * model.dtype_bytes / tp
        return self.weight_layers * per_layer

    def kv_bytes_per_token(self, model: ModelSpec, tp: int) -> int:
        """The drafter's KV per token on one GPU (bytes), added to the target's."""
        if not self.kv_layers:
            return 0
        return self.kv_layers * draft_layer_model(model).kv_bytes_per_token(tp)
