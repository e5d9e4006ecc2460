"""The scheduler side's instrumentation: requests admitted and finished, and what each step's metadata carries.

Its calls come per request (lookups, allocations, finishes) and per scheduler
step, in no fixed number, so they are sampled call by call: the composite
reads its calls through :class:`ChosenCalls`, where a timed operation's calls
count each composite call down (:class:`~kvcompose.instrumentation.sampling.CallSampler`)
and hand out the observed calls for the one it times. With tracing on, the
calls of a traced operation are always the observed ones: each asks the tracer
whether its request is sampled.

Hooks (the composite calls them):

- :meth:`admitted`: vLLM allocated a request's blocks. Its lookup round counts
  the first time only: vLLM allocates again for a request it admitted before
  (once an async load completes, when a preempted request resumes).
- :meth:`request_finished`: the request's span ends, whatever the children
  answered.
- :meth:`metadata_built`: each step's metadata carries the new requests' saves
  and the sampled requests to the workers, and asks them to flush their stats
  when the step runs no forward pass. The scheduler's own stats are flushed
  then too, and whenever no admitted request is left.
- :meth:`worker_output`: the transfer summaries the workers send back for
  traced requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvcompose.connectors.calls import Calls
from kvcompose.instrumentation.base import CallState, Instrumentation
from kvcompose.instrumentation.economics import StreamSampler
from kvcompose.instrumentation.sampling import CallSampler
from kvcompose.instrumentation.transfers import completion_mode, job_requests
from kvcompose.metrics.stats import ECONOMICS_KEY
from kvcompose.operations import OPERATIONS, Operation, Side

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvcompose.config import Pipeline
    from kvcompose.connectors.calls import ChildCalls
    from kvcompose.connectors.children import ChildSpec
    from kvcompose.connectors.ledger import SchedulerLedger
    from kvcompose.connectors.metadata import KVComposeMetadata, KVComposeWorkerMetadata


class _ChosenPerCall:
    """One scheduler operation's calls, chosen each time the composite reads them (once per composite call): the
    observed calls for a call the sampler times or, tracing on, for a call about a request that may be traced;
    else the plain calls."""

    __slots__ = ("plain", "observed", "_state", "_sampler", "_traced", "_samples")

    def __init__(self, state: CallState, sampler: CallSampler | None, traced: bool,
                 samples: SchedulerInstrumentation) -> None:
        self.plain: Calls = ()
        self.observed: Calls = ()
        self._state, self._sampler, self._traced, self._samples = state, sampler, traced, samples

    def __iter__(self) -> Iterator[Callable[..., Any]]:
        return iter(self._choose())

    def __getitem__(self, index: int) -> Callable[..., Any]:
        return self._choose()[index]

    def _choose(self) -> Calls:
        state = self._state
        if self._sampler is not None and (weight := self._sampler.count()):
            state.weight, state.sampled = weight, self._samples.next_sample()
            return self.observed
        state.weight = state.sampled = 0
        return self.observed if self._traced else self.plain


class ChosenCalls:
    """The scheduler's calls as the composite reads them: a timed or traced operation's are chosen per composite
    call (:class:`_ChosenPerCall`), any other operation's are its plain calls."""

    def __init__(self, instrumentation: SchedulerInstrumentation) -> None:
        for name in _CHOSEN:
            operation = OPERATIONS[name]
            setattr(self, name, _ChosenPerCall(instrumentation.state_of(operation), instrumentation.samplers.get(name),
                                               instrumentation.traces(operation), instrumentation))

    def update(self, operation: str, plain: Calls, observed: Calls) -> None:
        if operation in _CHOSEN:
            chosen = getattr(self, operation)
            chosen.plain, chosen.observed = plain, observed
        else:
            setattr(self, operation, plain)


# The scheduler's operations that may be timed or traced.
_CHOSEN = frozenset(name for name, operation in OPERATIONS.items()
                    if operation.forwarded and operation.side is Side.SCHEDULER and (operation.label or operation.traced))


class SchedulerInstrumentation(Instrumentation):
    """See the module docstring."""

    def __init__(
        self, pipeline: Pipeline, specs: list[ChildSpec], ledger: SchedulerLedger, engine_id: str,
        stream: StreamSampler | None,
    ) -> None:
        super().__init__(pipeline, specs, "scheduler", engine_id)
        self._ledger = ledger
        self._stream = stream if self.recorder.enabled else None  # the prefix-block stream, for tier economics
        self.samplers = {name: CallSampler(pipeline.metrics.sample_every) for name in _CHOSEN
                         if self.recorder.label(OPERATIONS[name]) is not None}
        # Children whose transfers are jobs in their metadata (their requests join the step's trace).
        self._job_children = [spec.index for spec in specs
                              if self.tracer is not None and completion_mode(spec.connector_cls) == "jobs"]
        self._admitted: set[str] = set()  # admitted requests not finished yet
        self._flush_at_take = False

    def calls_for(self, child_calls: ChildCalls) -> ChosenCalls:
        chosen = ChosenCalls(self)
        child_calls.add_view(chosen)
        return chosen

    # ---- hooks ----

    def admitted(self, request: Request, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (update_state_after_alloc returned)."""
        req_id = request.request_id
        if self.tracer is not None:
            self.tracer.request_admitted(req_id)
        if req_id in self._admitted:
            return
        self._admitted.add(req_id)
        if self._stream is not None:
            self._stream.admitted(request)
        looked_up = self._ledger.rounds.get(req_id)
        if looked_up is None:
            return
        loading = self._ledger.planned_loader(req_id)
        answers = looked_up[3]
        self.recorder.request_admitted(answers, self._ledger.loaders, loading, num_external_tokens)
        if self.tracer is not None and loading is not None:
            self.tracer.request_loaded(req_id, self.specs[loading].name, num_external_tokens)

    def request_finished(self, request: Request, saves_async: bool) -> None:
        """vLLM finished the request (every child was told). Once no admitted request is left, the next stats
        are flushed."""
        if self.tracer is not None:
            self.tracer.request_finished(request, saves_async=saves_async)
        self._admitted.discard(request.request_id)

    def metadata_built(self, scheduler_output: SchedulerOutput, metadata: KVComposeMetadata) -> None:
        """Add what the workers need to track transfers and join traces, and whether they flush their stats."""
        if new_requests := scheduler_output.scheduled_new_reqs:
            metadata.saves = {new.req_id: len(new.block_ids[0]) if new.block_ids else 0 for new in new_requests}
        if self.tracer is not None:
            moving = job_requests(metadata.per_child[index] for index in self._job_children)
            metadata.traced_requests = self.tracer.step_requests(scheduler_output, metadata.loads, moving)
        if not scheduler_output.total_num_scheduled_tokens:  # no forward pass: idle, or waiting
            metadata.flush_stats = self._flush_at_take = True
        # A request scheduled more than one token prefills them (decodes schedule one each).
        for tokens in scheduler_output.num_scheduled_tokens.values():
            if tokens > 1:
                metadata.prefill_tokens += tokens
            else:
                metadata.decode_tokens += tokens

    def worker_output(self, worker_metadata: KVComposeWorkerMetadata | None) -> None:
        """What the workers' metadata of a step reports: the transfers of traced requests that ended."""
        if self.tracer is not None and worker_metadata is not None and worker_metadata.summaries:
            self.tracer.add_summaries(worker_metadata.summaries)

    # ---- stats ----

    def uncount(self, operation: Operation) -> None:
        if (sampler := self.samplers.get(operation.name)) is not None:
            sampler.uncount()

    def reports(self, idle: bool) -> dict[str, Any]:
        if self._stream is not None and (report := self._stream.report(now=idle)) is not None:
            return {ECONOMICS_KEY: report}
        return {}

    def flush_due(self) -> bool:
        return self._flush_at_take or not self._admitted

    def flush(self) -> None:
        self._flush_at_take = False
        for name, sampler in self.samplers.items():
            self.credit_untimed(name, sampler.take_uncredited())

    def sizes(self) -> dict[str, int]:
        sizes = super().sizes()
        if self._admitted:
            sizes["admitted_requests"] = len(self._admitted)
        return sizes
