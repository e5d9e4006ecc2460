"""RoutingReport: how right the routers' predictions of cached tokens were, as the stats carry it.

A request may carry its router's prediction of the prompt tokens the engine
already holds (``kv_transfer_params: {"kvcompose": {"predicted_cached_tokens":
N}}``). When such a request finishes, the scheduler adds the prediction and
what the request reused (tokens the GPU prefix cache served plus tokens a
child loaded, failed loads excluded) to its report; a prediction that is not an
integer from 0 to the prompt's length counts as invalid and nothing else.
Merged reports add up (they are counts).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# The request's kv_transfer_params entry a router's prediction comes in, and the receipt goes out in (the key the
# prefill/decode pairing description uses too: kvcompose.connectors.pairing).
PARAMS_KEY = "kvcompose"
PREDICTED_KEY = "predicted_cached_tokens"
# Under kvcompose serve, the header a router may send its prediction in instead (kvcompose.prediction_header).
PREDICTED_HEADER = "x-kvcompose-predicted-cached-tokens"


@dataclass
class RoutingReport:
    """Counts of the predictions of requests finished since the last report."""

    predictions: int = 0  # requests that carried a valid prediction
    predicted_tokens: int = 0  # the sum of their predictions
    reused_tokens: int = 0  # the sum of their GPU-cached plus loaded tokens
    overpredicted_tokens: int = 0  # the sum of max(predicted - reused, 0)
    underpredicted_tokens: int = 0  # the sum of max(reused - predicted, 0)
    invalid: int = 0  # requests whose prediction was not an integer from 0 to the prompt's length

    def predicted(self, predicted: int, reused: int) -> None:
        """One request's valid prediction and the tokens it reused."""
        self.predictions += 1
        self.predicted_tokens += predicted
        self.reused_tokens += reused
        if predicted > reused:
            self.overpredicted_tokens += predicted - reused
        else:
            self.underpredicted_tokens += reused - predicted

    def add(self, other: RoutingReport) -> None:
        for each in fields(self):
            setattr(self, each.name, getattr(self, each.name) + getattr(other, each.name))

    def is_empty(self) -> bool:
        return not (self.predictions or self.invalid)

    def copy(self) -> RoutingReport:
        return RoutingReport(**self.to_dict())

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: the predictions and their error."""
        if self.is_empty():
            return {}
        return {"router_predictions": self.predictions, "router_overpredicted_tokens": self.overpredicted_tokens,
                "router_underpredicted_tokens": self.underpredicted_tokens,
                "router_predictions_invalid": self.invalid}

    def to_dict(self) -> dict[str, Any]:
        return {each.name: getattr(self, each.name) for each in fields(self)}

    @classmethod
    def from_payload(cls, payload: RoutingReport | dict[str, Any]) -> RoutingReport:
        if isinstance(payload, RoutingReport):
            return payload
        return cls(**{each.name: int(payload.get(each.name, 0)) for each in fields(cls)})
