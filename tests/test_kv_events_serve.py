"""vLLM's KV events under the OpenAI server, with a real ZMQ subscriber: each child's blocks arrive as it emitted them.

vLLM publishes, after each step, the GPU cache's events and the connector's ``take_events``
(vllm/v1/core/sched/scheduler.py); the composite hands vLLM its children's events one child after the other.
The served pipeline has two OffloadingConnector children (kvcompose's CPU spec) of different sizes, each
writing down every event it hands vLLM (tests/counting_children.py): ``small`` holds 3 blocks, ``large`` 5, so
four prompts of three blocks each make both store and evict, at different times. A SUB socket on the server's
ZMQ publisher decodes each batch with vLLM's own ``KVEventBatch``; the events that are not the GPU cache's
must be exactly the children's, in the order they emitted them, each with its child's medium. Both children
report medium "CPU": nothing in an event tells them apart (docs/receipts.md, "Two tiers, one medium").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvcompose.offload import SPEC_MODULE, SPEC_NAME
from kvcompose.testing.tiny_model import prompt_words

from .counting_children import event_record
from .server_support import Server, start_server

pytestmark = pytest.mark.engine

BLOCK = 128  # the CPU engine's block size, in tokens
BLOCK_BYTES = 2 * 2 * BLOCK * 64 * 4  # the tiny model's KV per block: layers, K and V, tokens, head dim, fp32
CAPACITY_BLOCKS = {"small": 3, "large": 5}
PROMPTS = [prompt_words(seed=410 + index, length=300) for index in range(4)]  # three full blocks each
GPU_MEDIUM = "GPU"
STEPS_FOR_STORES = 30  # short requests sent, at most, for the last stores' events to be taken
RECEIVE_TIMEOUT_MS = 120_000  # a failing run stops waiting for the events the children recorded


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path, str, str]]:
    root = tmp_path_factory.mktemp("kv-events")
    record = root / "events.jsonl"
    record.touch()
    children = [{"name": name, "connector": "EventRecordingOffloadingConnector", "module_path": "tests.counting_children",
                 "config": {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE,
                            "cpu_bytes_to_use": blocks * BLOCK_BYTES, "events_record": str(record), "label": name}}
                for name, blocks in CAPACITY_BLOCKS.items()]
    pipeline = {"version": 1, "name": "two-offload-tiers", "children": children}
    config = {"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
              "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}}
    publisher, replay = f"ipc://{root}/kv-events", f"ipc://{root}/kv-events-replay"
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": publisher,
                     "replay_endpoint": replay}
    server = start_server(tiny_model, json.dumps(config), root / "server.log",
                          extra_args=["--kv-events-config", json.dumps(events_config), "--enable-prefix-caching"])
    yield server, record, publisher, replay
    server.stop()


def test_each_childs_stored_and_removed_blocks_reach_a_subscriber_as_the_child_emitted_them(
        served: tuple[Server, Path, str, str]) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    server, record, publisher, replay = served
    context = zmq.Context.instance()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(publisher)
    try:
        answers = [server.complete(prompt) for prompt in PROMPTS]
        prompt_blocks = sum(answer["usage"]["prompt_tokens"] // BLOCK for answer in answers)  # full blocks
        emitted = _after_every_store(server, record, prompt_blocks * len(CAPACITY_BLOCKS))
        batches = _receive_until(subscriber, replay, KVEventBatch, lambda got: len(_tiers(got)) >= len(emitted))
    finally:
        subscriber.close(linger=0)

    received, gpu = _tiers(batches), _gpu_cache(batches)
    # Step by step, the children in pipeline order (MultiConnector's), each child's events as it yielded them.
    positions = list(CAPACITY_BLOCKS)
    in_order = sorted(emitted, key=lambda event: (event["take"], positions.index(event["child"])))
    assert [{key: event[key] for key in ("kind", "medium", "blocks", "digest")} for event in in_order] == \
        [event_record(event) for event in received]
    assert all(isinstance(event, (BlockStored, BlockRemoved)) for event in received)
    by_child = {child: [event for event in emitted if event["child"] == child] for child in CAPACITY_BLOCKS}
    for child, events in by_child.items():  # both stored and evicted, all in host memory
        assert {event["kind"] for event in events} == {"BlockStored", "BlockRemoved"}, (child, events)
        assert {event["medium"] for event in events} == {"CPU"}, (child, events)
    stored = {child: sum(e["blocks"] for e in events if e["kind"] == "BlockStored") for child, events in by_child.items()}
    removed = {child: sum(e["blocks"] for e in events if e["kind"] == "BlockRemoved")
               for child, events in by_child.items()}
    # Nothing in an event names its child: both children's stores of the same blocks are the same bytes.
    assert len({tuple(e["digest"] for e in events if e["kind"] == "BlockStored") for events in by_child.values()}) == 1
    # Both stored every full block of every prompt; each evicted what no longer fit.
    assert stored == dict.fromkeys(CAPACITY_BLOCKS, prompt_blocks), stored
    assert removed == {child: stored[child] - blocks for child, blocks in CAPACITY_BLOCKS.items()}, removed

    # The GPU cache's own events came too, under its medium, for the same blocks: a router keys both by block.
    gpu_stored = {h for event in gpu if isinstance(event, BlockStored) for h in event.block_hashes}
    assert gpu_stored, gpu
    assert {h for event in received if isinstance(event, BlockStored) for h in event.block_hashes} <= gpu_stored

    log = server.log.read_text(errors="replace")
    hashes = {block_hash for event in received for block_hash in event.block_hashes}
    assert hashes and not [form for block_hash in hashes for form in _written_forms(block_hash) if form in log]


def _after_every_store(server: Server, record: Path, expected: int) -> list[dict[str, Any]]:
    """The children's record once both have reported every prompt's blocks stored. A store's copy ends on the
    spec's copy thread; vLLM takes its event at a later step, so short requests keep steps coming meanwhile."""
    for attempt in range(STEPS_FOR_STORES):
        emitted = [json.loads(line) for line in record.read_text().splitlines()]
        if sum(event["blocks"] for event in emitted if event["kind"] == "BlockStored") >= expected:
            return emitted
        server.complete(prompt_words(seed=420 + attempt, length=40), max_tokens=2)
    raise AssertionError(f"the children reported fewer than {expected} blocks stored: {emitted}")


def _receive_until(subscriber: zmq.Socket, replay: str, batch_type: type, done: Any) -> list[Any]:
    """Batches in sequence order from the SUB socket until ``done(batches)``; those published before the
    subscription took hold are asked again from the publisher's replay socket, as vLLM's subscribers do."""
    decoder = msgspec.msgpack.Decoder(type=batch_type)
    by_seq: dict[int, Any] = {}
    while not done([by_seq[seq] for seq in sorted(by_seq)]):
        _topic, seq, payload = subscriber.recv_multipart()
        by_seq[int.from_bytes(seq, "big")] = decoder.decode(payload)
        if min(by_seq) > 0:
            by_seq.update(_replayed(subscriber.context, replay, decoder, before=min(by_seq)))
    assert sorted(by_seq) == list(range(len(by_seq))), sorted(by_seq)  # no batch missed
    return [by_seq[seq] for seq in sorted(by_seq)]


def _replayed(context: zmq.Context, replay: str, decoder: msgspec.msgpack.Decoder, before: int) -> dict[int, Any]:
    requester = context.socket(zmq.DEALER)
    requester.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    requester.connect(replay)
    try:
        requester.send_multipart((b"", (0).to_bytes(8, "big")))  # the publisher's ROUTER: (identity, b"", seq)
        batches: dict[int, Any] = {}
        while True:
            _empty, _topic, seq_bytes, payload = requester.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                return {seq: batch for seq, batch in batches.items() if seq < before}
            batches[seq] = decoder.decode(payload)
    finally:
        requester.close(linger=0)


def _tiers(batches: list[Any]) -> list[Any]:
    """The events of the connector's children, in publishing order: every event but the GPU cache's."""
    return [event for batch in batches for event in batch.events if getattr(event, "medium", None) != GPU_MEDIUM]


def _gpu_cache(batches: list[Any]) -> list[Any]:
    return [event for batch in batches for event in batch.events if getattr(event, "medium", None) == GPU_MEDIUM]


def _written_forms(block_hash: int | bytes) -> set[str]:
    """An event's block hash (a 64-bit integer by default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) as a log line
    could write it: decimal, signed decimal, hex."""
    if isinstance(block_hash, bytes):
        return {block_hash.hex(), repr(block_hash)[2:-1]}
    return {str(block_hash), str(block_hash - (1 << 64)), format(block_hash, "x")}
