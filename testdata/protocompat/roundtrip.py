"""The Python side of proto/compat_test.go: SMG's own generated proto
(smg_grpc_proto, the package gateways and SMG servicers use) as the peer.

    roundtrip.py samples       print {name: {"type", "hex"}}: fully populated
                               messages built and encoded by smg_grpc_proto
    roundtrip.py decode        read {name: {"type", "hex"}} on stdin (bytes the
                               Go side encoded); print {name: {"json", "hex",
                               "unknown_fields"}}: the message as json_format
                               sees it, re-encoded by Python, and the numbers of
                               the fields Python does not know
    roundtrip.py descriptors   print the FileDescriptorProtos (JSON) of
                               common.proto and the three engine services

The sample values are repeated literally in compat_test.go; the two sides are
written independently so a disagreement in numbering, types or presence shows.
"""

from __future__ import annotations

import json
import sys

from google.protobuf import descriptor_pb2, json_format, unknown_fields
from smg_grpc_proto.generated import (
    common_pb2 as pb,
    sglang_scheduler_pb2,
    tokenspeed_scheduler_pb2,
    vllm_engine_pb2,
)

U64_MAX = (1 << 64) - 1
I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
U32_MAX = (1 << 32) - 1
I32_MAX = (1 << 31) - 1
I32_MIN = -(1 << 31)


def batch_events() -> pb.KvEventBatch:
    out = pb.KvEventBatch(sequence_number=U64_MAX, timestamp=1700000000.5)
    out.dp_rank = 0  # explicit presence of a zero
    stored = pb.KvBlocksStored(
        blocks=[
            pb.KvBlock(
                block_hash=I64_MIN,
                token_ids=[0, U32_MAX, 7],
                block_size=3,
                lora_id=-1,
                cache_level=0,
                extra_keys=[
                    pb.KvBlockExtraKey(text="tenant-a"),
                    pb.KvBlockExtraKey(blob=b"\x00\xff"),
                    pb.KvBlockExtraKey(number=I64_MIN),
                    pb.KvBlockExtraKey(
                        multimodal=pb.KvMultimodalKey(identifier="img0", offset=I64_MAX)
                    ),
                ],
            ),
            pb.KvBlock(block_hash=I64_MAX, token_ids=[1, 2, 3], block_size=3),
        ],
        parent_block_hash=0,
        tier=pb.KV_CACHE_TIER_HOST,
        medium="CPU",
        group_idx=U32_MAX,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=0,
        locality=pb.KV_CACHE_LOCALITY_REMOTE,
        ownership="lmcache",
        session_id="sess-\u00fc",
        lora_name="adapter",
        cache_salt="salt",
    )
    removed = pb.KvBlocksRemoved(
        block_hashes=[-1, 0, 1],
        cache_level=3,
        tier=pb.KV_CACHE_TIER_EXTERNAL,
        medium="SHARED",
        group_idx=0,
        locality=pb.KV_CACHE_LOCALITY_LOCAL,
        ownership="o",
    )
    out.events.extend(
        [
            pb.KvCacheEvent(event_id=1, stored=stored),
            pb.KvCacheEvent(event_id=2, removed=removed),
            pb.KvCacheEvent(event_id=U64_MAX, cleared=pb.KvCacheCleared(ownership="kvcr")),
            pb.KvCacheEvent(event_id=4, cleared=pb.KvCacheCleared()),
        ]
    )
    return out


def batch_snapshot() -> pb.KvEventBatch:
    out = pb.KvEventBatch(
        sequence_number=42,
        timestamp=0.25,
        snapshot=pb.KvSnapshotChunk(index=3, count=U32_MAX, blocks=U64_MAX, unknown_before=1),
        events=[pb.KvCacheEvent(cleared=pb.KvCacheCleared())],
    )
    out.dp_rank = I32_MAX
    return out


def batch_load() -> pb.KvEventBatch:
    load = pb.EngineLoad(
        running_requests=U32_MAX,
        waiting_requests=1,
        waiting_uncached_tokens=0,
        token_usage=0.75,
        active_token_usage=0.0,
        gen_throughput=1234.5,
        max_running_requests=256,
        age_ms=7,
        sample=U64_MAX,
        load_only=True,
        cache_hit_rate=0.5,
        num_used_tokens=-3,
        max_total_num_tokens=I32_MAX,
        memory=pb.EngineMemory(weight_gb=1.5, kv_cache_gb=2.5, graph_gb=3.5, token_capacity=I32_MIN),
        queues=pb.EngineQueues(waiting=1, grammar=2, paused=3, retracted=4),
        speculative=pb.EngineSpeculative(accept_length=2.25, accept_rate=0.875),
        lora=pb.EngineLora(slots_used=1, slots_total=8, utilization=0.125),
        disaggregation=pb.EngineDisaggregation(
            mode="prefill",
            prefill_prealloc_queue_reqs=1,
            prefill_inflight_queue_reqs=2,
            decode_prealloc_queue_reqs=3,
            decode_transfer_queue_reqs=4,
            decode_retracted_queue_reqs=5,
            kv_transfer_speed_gb_s=10.5,
            kv_transfer_latency_ms=0.75,
        ),
        engine_silence_ms=1500,
        engine_reports_steps=False,
        prefill_pending_tokens=U32_MAX,
    )
    out = pb.KvEventBatch(sequence_number=43, timestamp=-1.5, load=load)
    out.dp_rank = -1
    return out


def samples() -> dict[str, tuple[str, object]]:
    return {
        "batch_events": ("KvEventBatch", batch_events()),
        "batch_snapshot": ("KvEventBatch", batch_snapshot()),
        "batch_load": ("KvEventBatch", batch_load()),
        "request": (
            "SubscribeKvEventsRequest",
            pb.SubscribeKvEventsRequest(
                start_sequence_number=U64_MAX, load_records_before_first_batch=True
            ),
        ),
        "request_empty": ("SubscribeKvEventsRequest", pb.SubscribeKvEventsRequest()),
    }


def cmd_samples() -> dict:
    return {
        name: {"type": type_name, "hex": message.SerializeToString().hex()}
        for name, (type_name, message) in samples().items()
    }


def cmd_decode(request: dict) -> dict:
    out = {}
    for name, item in request.items():
        cls = getattr(pb, item["type"])
        message = cls.FromString(bytes.fromhex(item["hex"]))
        out[name] = {
            "json": json_format.MessageToDict(message, preserving_proto_field_name=True),
            "hex": message.SerializeToString().hex(),
            "unknown_fields": sorted({f.field_number for f in unknown_fields.UnknownFieldSet(message)}),
        }
    return out


def cmd_descriptors() -> dict:
    files = {}
    for module in (pb, sglang_scheduler_pb2, vllm_engine_pb2, tokenspeed_scheduler_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        files[module.DESCRIPTOR.name] = json_format.MessageToDict(proto, preserving_proto_field_name=True)
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("samples", "decode", "descriptors"):
        print("usage: roundtrip.py samples|decode|descriptors", file=sys.stderr)
        return 2
    if argv[1] == "samples":
        result = cmd_samples()
    elif argv[1] == "decode":
        result = cmd_decode(json.load(sys.stdin))
    else:
        result = cmd_descriptors()
    json.dump(result, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
