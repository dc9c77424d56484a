"""Generates kvrelay's golden KV-event vectors (testdata/golden/*.json).

Run from the repository root with the venv's interpreter:

    .venv/bin/python testdata/golden/gen.py

Every payload is either encoded here by the real ``msgspec`` from Struct
declarations that follow each engine version's field order (engine-wire.md
§3.2-3.5), or copied from a public capture/golden (engine-wire.md §3.6 and §5).
The expected normalized output comes from an independent oracle: the Python
SMG relay's normalizer (``smg_grpc_servicer.kv_relay``), rendered with
``google.protobuf.json_format``. Where kvrelay intentionally differs from the
Python relay, the expectation is written out here by hand, next to a comment
saying why; README.md lists those differences.

Vector file format (one file per vector set):

    {
      "name", "description", "source",
      "engines": ["vllm", "sglang", "tokenspeed"],   # normalizers to check
      "payloads": [{
          "hex": "...", "seq": N, "rank": R, "note": "...",
          "expected": {"batch": <protojson>, "drops": {reason: n}}
                   | {"error": "undecodable"},
          "expected_by_engine": {"sglang": {...}},   # optional override
          "differs_from_python": "..."               # optional
      }]
    }

All payloads of one set go through one fresh normalizer per engine, in order,
so state (namespaces, copies, learned groups) carries across them.
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys
from typing import Any, Optional, Union

import msgspec
from google.protobuf import json_format
from smg_grpc_proto.generated import common_pb2 as pb
from smg_grpc_servicer import kv_relay

OUT = pathlib.Path(__file__).resolve().parent
ALL = ["vllm", "sglang", "tokenspeed"]
TS = 1700000000.5  # cb41d954fc40200000, the ts of engine-wire.md §3.6
DEVICE, HOST, DISK, EXTERNAL = (
    pb.KV_CACHE_TIER_DEVICE,
    pb.KV_CACHE_TIER_HOST,
    pb.KV_CACHE_TIER_DISK,
    pb.KV_CACHE_TIER_EXTERNAL,
)
LOCAL = pb.KV_CACHE_LOCALITY_LOCAL
Hash = Union[int, bytes]

# ---------------------------------------------------------------------------
# vLLM schemas, one family of Structs per era (engine-wire.md §3.2-3.3).
# array_like structs write every field (omit_defaults has no effect on them),
# so each era's array length is its field count plus the tag.
# ---------------------------------------------------------------------------


class VllmArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


# vllm#16750: the first KV events.
class V0Stored(VllmArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]


class V0Removed(VllmArrayEvent, tag="BlockRemoved"):
    block_hashes: list


class V0Cleared(VllmArrayEvent, tag="AllBlocksCleared"):
    pass


class V0Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


# vllm#19737: medium on stores and removals.
class V1Stored(VllmArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class V1Removed(VllmArrayEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str]


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The positional batch every later vLLM keeps (even after #42892)."""

    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


# vllm#27577: lora_name.
class V2Stored(VllmArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


# vllm#33304: extra_keys.
class V3Stored(VllmArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None


# vllm#37688: group_idx.
class V4Stored(VllmArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None


class V4Removed(VllmArrayEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str]
    group_idx: Optional[int] = None


# vllm#40984: the last array era (12-element stores, <= v0.23).
class V5Stored(VllmArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


# vllm#42892 and later: tagged maps (omit_defaults drops defaulted None
# fields; required fields are always present, even as nil). Includes
# locality (#48281), ownership (#52067), session_id (#51381).
class VllmMapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VMStored(VllmMapEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[Hash]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class VMRemoved(VllmMapEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class VMCleared(VllmMapEvent, tag="AllBlocksCleared"):
    pass


# Not in any vLLM release: an AllBlocksCleared carrying ownership, which both
# SMG relays read (a residency agent's clear); shapes the kvcr gate.
class VMClearedOwned(VllmMapEvent, tag="AllBlocksCleared"):
    ownership: Optional[str] = None


# Proposed, unmerged events (vllm#50732 BlockInactive, #57296
# TierBlocksCleared): a decoder must skip unknown tags.
class VMInactive(VllmMapEvent, tag="BlockInactive"):
    block_hashes: list
    medium: Optional[str]


class VMTierCleared(VllmMapEvent, tag="TierBlocksCleared"):
    medium: Optional[str]


class V5Inactive(VllmArrayEvent, tag="BlockInactive"):
    block_hashes: list
    medium: Optional[str]


# ---------------------------------------------------------------------------
# SGLang schemas (engine-wire.md §3.4)
# ---------------------------------------------------------------------------


class SglArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


# @006d053f: the oldest shape, no rank in the batch.
class S0Stored(SglArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int]


class S0Removed(SglArrayEvent, tag="BlockRemoved"):
    block_hashes: list


class S0Cleared(SglArrayEvent, tag="AllBlocksCleared"):
    pass


class S0Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list


class SBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list
    attn_dp_rank: Optional[int] = None


# sglang#18205: medium (defaulted, still written: arrays).
class S1Stored(SglArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class S1Removed(SglArrayEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str] = None


# sglang#30827: a salted store is BlockStoredWithMetadata, an 8th element.
class SMetadata(msgspec.Struct):
    cache_salt: str


class S2StoredWithMetadata(S1Stored, tag="BlockStored", kw_only=True):
    metadata: SMetadata


# sglang#37482: tagged maps; cache_salt and session_id become fields.
class SglMapEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class SMStored(SglMapEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None


class SMRemoved(SglMapEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str] = None


class SMCleared(SglMapEvent, tag="AllBlocksCleared"):
    pass


# ---------------------------------------------------------------------------
# TokenSpeed schemas (engine-wire.md §3.5, @d8e54692)
# ---------------------------------------------------------------------------


class TsEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class TStored(TsEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int


class TRemoved(TsEvent, tag="BlockRemoved"):
    block_hashes: list


class TBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    attn_dp_rank: Optional[int] = None


enc = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return enc.encode(obj)


# ---------------------------------------------------------------------------
# Expected-output builders for the intended differences (hand-written)
# ---------------------------------------------------------------------------

_CACHE_LEVEL = {DEVICE: None, HOST: 1, DISK: 2, EXTERNAL: 3}


def stored(
    event_id: int,
    blocks: list[tuple[int, list[int]]],
    *,
    parent: int | None = None,
    tier: int = DEVICE,
    medium: str | None = None,
    lora_id: int | None = None,
    **optional: Any,
) -> pb.KvCacheEvent:
    """A forwarded store as kvrelay emits it: every block block_size wide,
    locality LOCAL, the optional fields given by name."""
    out = pb.KvBlocksStored(tier=tier, locality=LOCAL)
    for block_hash, tokens in blocks:
        block = out.blocks.add(block_hash=block_hash, token_ids=tokens, block_size=len(tokens))
        if lora_id is not None:
            block.lora_id = lora_id
        if _CACHE_LEVEL[tier] is not None:
            block.cache_level = _CACHE_LEVEL[tier]
    if parent is not None:
        out.parent_block_hash = parent
    if medium is not None:
        out.medium = medium
    for name, value in optional.items():
        if value is not None:
            setattr(out, name, value)
    return pb.KvCacheEvent(event_id=event_id, stored=out)


def removed(
    event_id: int, hashes: list[int], *, tier: int = DEVICE, medium: str | None = None, **optional
) -> pb.KvCacheEvent:
    out = pb.KvBlocksRemoved(block_hashes=hashes, tier=tier, locality=LOCAL)
    if _CACHE_LEVEL[tier] is not None:
        out.cache_level = _CACHE_LEVEL[tier]
    if medium is not None:
        out.medium = medium
    for name, value in optional.items():
        if value is not None:
            setattr(out, name, value)
    return pb.KvCacheEvent(event_id=event_id, removed=out)


def batch(seq: int, ts: float, rank: int | None, events: list[pb.KvCacheEvent]) -> pb.KvEventBatch:
    out = pb.KvEventBatch(sequence_number=seq, timestamp=ts, events=events)
    if rank is not None:
        out.dp_rank = rank
    return out


def expectation(proto: pb.KvEventBatch, drops: dict[str, int]) -> dict:
    return {"batch": json_format.MessageToDict(proto), "drops": dict(sorted(drops.items()))}


UNDECODABLE = {"error": "undecodable"}

# ---------------------------------------------------------------------------
# Vector sets
# ---------------------------------------------------------------------------


class VectorSet:
    """Payloads normalized in order by one Python relay normalizer (the oracle)."""

    def __init__(self, name: str, description: str, source: str, engines=None):
        self.name = name
        self.description = description
        self.source = source
        self.engines = list(engines or ALL)
        self.oracle = kv_relay.Normalizer()
        self.payloads: list[dict] = []

    def oracle_output(self, payload: bytes, seq: int, rank: int):
        """What the Python relay makes of payload: (proto, drops) or None when
        the envelope does not decode."""
        try:
            wire = kv_relay.decode_batch(payload)
        except Exception:  # noqa: BLE001 - msgspec.DecodeError or ValueError
            return None
        before = dict(self.oracle.counts.dropped)
        # A negative socket rank means "unknown": the payload's rank is used,
        # which is the Python relay's dp_rank=None.
        proto = self.oracle.normalize_batch(wire, seq, rank if rank >= 0 else None)
        drops = {
            reason: n - before.get(reason, 0)
            for reason, n in self.oracle.counts.dropped.items()
            if n != before.get(reason, 0)
        }
        return proto, drops

    def add(
        self,
        payload: bytes,
        *,
        seq: int = 0,
        rank: int = 0,
        note: str = "",
        ours=None,
        differs: str | None = None,
        ours_by_engine: dict | None = None,
    ) -> tuple[pb.KvEventBatch | None, dict]:
        """Add a payload. Without ``ours`` the Python relay's output is the
        expectation; with it (a (proto, drops) pair, or UNDECODABLE), kvrelay's
        intended output replaces it and ``differs`` must say why."""
        result = self.oracle_output(payload, seq, rank)
        entry: dict[str, Any] = {"hex": payload.hex(), "seq": seq, "rank": rank, "note": note}
        if result is None:
            entry["expected"] = UNDECODABLE
        else:
            entry["expected"] = expectation(*result)
        python_expected = entry["expected"]
        if ours is not None:
            if not differs:
                raise SystemExit(f"{self.name}: an override needs a reason")
            entry["expected"] = ours if ours is UNDECODABLE else expectation(*ours)
            entry["differs_from_python"] = differs
            entry["python_relay_output"] = python_expected
        if ours_by_engine:
            if not differs:
                raise SystemExit(f"{self.name}: an override needs a reason")
            entry["expected_by_engine"] = {
                engine: expectation(*value) for engine, value in ours_by_engine.items()
            }
            entry["differs_from_python"] = differs
            entry["python_relay_output"] = python_expected
        self.payloads.append(entry)
        return (result[0] if result else None), (result[1] if result else {})

    def write(self) -> None:
        doc = {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "engines": self.engines,
            "payloads": self.payloads,
        }
        path = OUT / f"{self.name}.json"
        path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")


SETS: list[VectorSet] = []


def vector_set(name, description, source, engines=None) -> VectorSet:
    vs = VectorSet(name, description, source, engines)
    SETS.append(vs)
    return vs


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SystemExit(f"self-check failed: {what}")


def event_ids(proto: pb.KvEventBatch) -> list[int]:
    return [e.event_id for e in proto.events]


# The §3.6 worked example: tokens 1..8, block size 4, two blocks.
V_A, V_B = 9561501211280363793, 15292913576410714033  # vLLM sha256_cbor, unsigned
S_A, S_B = -3488128144981237669, 5674439469042975057  # SGLang
SALT_A, SALT_B = 3718046898735569995, 3308615664605479373  # SGLang, salt "tenant-a"
T8 = [1, 2, 3, 4, 5, 6, 7, 8]
DIGEST_A = bytes.fromhex("58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111")
DIGEST_B = bytes.fromhex("e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1")


def s64(value: int) -> int:
    """An unsigned 64-bit hash as the proto's int64 bit pattern."""
    return value - (1 << 64) if value >= 1 << 63 else value


# ----- §3.6 worked encodings ------------------------------------------------


def worked_encodings() -> None:
    # vLLM map events (after #42892), 202 bytes.
    vllm_map = encode(
        VBatch(
            TS,
            [
                VMStored(
                    [V_A, V_B], None, T8, 4, None, "GPU", None,
                    extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention",
                )
            ],
            0,
        )
    )
    check(
        vllm_map.hex()
        == "93cb41d954fc40200000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392"
        "cf84b146b151d55111cfd43b57df56b58fb1b1706172656e745f626c6f636b5f68617368c0a9746f6b656e"
        "5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347"
        "5055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63"
        "616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00",
        "vLLM map batch equals engine-wire.md §3.6",
    )
    minimal = encode(VMStored([V_A, V_B], None, T8, 4, None, "GPU", None))
    check(
        minimal.hex()
        == "88a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf84b146b151d55111cfd4"
        "3b57df56b58fb1b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405"
        "060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e"
        "616d65c0",
        "vLLM minimal map event equals §3.6",
    )
    vllm_array = encode(
        VBatch(
            TS,
            [V5Stored([V_A, V_B], None, T8, 4, None, "GPU", None, [None, None], 0, "full_attention", None)],
            0,
        )
    )
    check(
        vllm_array.hex()
        == "93cb41d954fc40200000919cab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1"
        "c098010203040506070804c0a3475055c092c0c000ae66756c6c5f617474656e74696f6ec000",
        "vLLM 12-element array equals §3.6",
    )
    vllm_16750 = encode(V0Batch(TS, [V0Stored([V_A, V_B], None, T8, 4, None)]))
    check(
        vllm_16750.hex()
        == "92cb41d954fc402000009196ab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1c098010203040506070804c0",
        "vLLM #16750 batch equals §3.6",
    )
    check(
        encode(VMRemoved([V_A, V_B], "GPU", group_idx=0)).hex()
        == "84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cf84b146b151d55111cfd43b57df56b58fb1a66d656469756da3475055a967726f75705f69647800",
        "vLLM map removal equals §3.6",
    )
    check(encode(VMCleared()).hex() == "81a474797065b0416c6c426c6f636b73436c6561726564", "map clear")
    check(encode(V0Cleared()).hex() == "91b0416c6c426c6f636b73436c6561726564", "array clear")
    check(
        encode(DIGEST_A).hex()
        == "c42058d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
        "bytes hash equals §3.6",
    )
    sgl_map = encode(SBatch(TS, [SMStored([S_A, S_B], None, T8, 4, None, medium="GPU")], 0))
    check(
        sgl_map.hex()
        == "93cb41d954fc402000009187a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392"
        "d3cf97adeedb59e05bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e"
        "5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347"
        "505500",
        "SGLang map batch equals §3.6",
    )
    sgl_salted_map_event = encode(
        SMStored([SALT_A, SALT_B], None, T8, 4, None, medium="GPU", cache_salt="tenant-a")
    )
    check(
        sgl_salted_map_event.hex()
        == "88a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf339927f491605c4bcf2d"
        "ea906acb1a41cdb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405"
        "060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055aa63616368655f"
        "73616c74a874656e616e742d61",
        "SGLang salted map event equals §3.6",
    )
    sgl_medium = encode(SBatch(TS, [S1Stored([S_A, S_B], None, T8, 4, None, "GPU")], 0))
    check(
        sgl_medium.hex()
        == "93cb41d954fc402000009197ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151c098010203040506070804c0a347505500",
        "SGLang medium-era array equals §3.6",
    )
    sgl_salted = encode(
        SBatch(TS, [S2StoredWithMetadata([SALT_A, SALT_B], None, T8, 4, None, "GPU", metadata=SMetadata("tenant-a"))], 0)
    )
    check(
        sgl_salted.hex()
        == "93cb41d954fc402000009198ab426c6f636b53746f72656492cf339927f491605c4bcf2dea906acb1a41cdc098010203040506070804c0a347505581aa63616368655f73616c74a874656e616e742d6100",
        "SGLang salted array equals §3.6",
    )
    sgl_oldest = encode(S0Batch(TS, [S0Stored([S_A, S_B], None, T8, 4, None)]))
    check(
        sgl_oldest.hex()
        == "92cb41d954fc402000009196ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151c098010203040506070804c0",
        "SGLang oldest array equals §3.6",
    )
    ts_batch = encode(TBatch(TS, [TStored([V_A, V_B], None, T8, 4)], 0))
    check(
        ts_batch.hex()
        == "93cb41d954fc402000009195ab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1c09801020304050607080400",
        "TokenSpeed batch equals §3.6",
    )

    vs = vector_set(
        "worked_encodings",
        "engine-wire.md §3.6: one BlockStored of two blocks (tokens 1..8, block size 4) in every "
        "engine's encoding; the msgspec Structs here reproduce each hex byte for byte.",
        "engine-wire.md §3.6",
    )
    for i, (payload, note) in enumerate(
        [
            (vllm_map, "vLLM map event (after #42892), 202 bytes"),
            (vllm_array, "vLLM last array era (12-element store)"),
            (vllm_16750, "vLLM #16750 ([ts, [6-element event]])"),
            (encode(VBatch(TS, [VMStored([DIGEST_A, DIGEST_B], None, T8, 4, None, "GPU", None)], 0)),
             "vLLM map event with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (32-byte digests)"),
            (sgl_map, "SGLang map event (#37482)"),
            (sgl_medium, "SGLang medium-era 7-element array"),
            (sgl_oldest, "SGLang oldest ([ts, [6-element event]])"),
            (ts_batch, "TokenSpeed 5-element array"),
        ]
    ):
        # Each is the same 2-block store: a fresh rank per payload keeps the
        # copies of one payload from counting as duplicates of another.
        vs.add(payload, seq=i, rank=i, note=note)

    # The salted SGLang array: the Python relay reads the 8th element as
    # vLLM's lora_name slot (a map, so not text) and loses the salt; kvrelay's
    # SGLang dialect knows the engine and recovers cache_salt from it.
    salted_ours = batch(
        0, TS, 0, [stored(1, [(SALT_A, T8[:4]), (SALT_B, T8[4:])], medium="GPU", cache_salt="tenant-a")]
    )
    vs2 = vector_set(
        "sglang_salted_arrays",
        "sglang#30827: a salted store is BlockStoredWithMetadata, an 8th array element "
        "{cache_salt}. Under the SGLang dialect the salt is recovered and inherited by an "
        "unsalted child; under the other dialects the slot is vLLM's lora_name and the salt is lost.",
        "msgspec from sglang#30827 structs; §3.6 salted hex",
    )
    vs2.add(
        sgl_salted,
        seq=0,
        note="salted store (8-element array)",
        ours_by_engine={"sglang": (salted_ours, {})},
        differs="SGLang dialect recovers cache_salt from the 8th element (the Python relay cannot "
        "tell it from vLLM's lora_name slot)",
    )
    # An unsalted child chained on the salted block: inherits the salt from its parent's record.
    child_payload = encode(SBatch(TS + 1, [S1Stored([77], SALT_B, [9, 10, 11, 12], 4, None, "GPU")], 0))
    child_ours = batch(
        1, TS + 1, 0, [stored(2, [(77, [9, 10, 11, 12])], parent=SALT_B, medium="GPU", cache_salt="tenant-a")]
    )
    vs2.add(
        child_payload,
        seq=1,
        note="unsalted 7-element child of the salted block inherits its salt",
        ours_by_engine={"sglang": (child_ours, {})},
        differs="the parent's record holds the recovered salt under the SGLang dialect",
    )
    # A salted store whose salt is empty: counts as absent, as an empty map salt does.
    vs2.add(
        encode(SBatch(TS + 2, [S2StoredWithMetadata([78], None, [1, 2, 3, 4], 4, None, "CPU_TIER1", metadata=SMetadata(""))], 0)),
        seq=2,
        note="empty cache_salt counts as absent (host tier)",
    )


# ----- vLLM eras ----------------------------------------------------------------


def vllm_eras() -> None:
    vs = vector_set(
        "vllm_16750_arrays",
        "vllm#16750: 2-element batch, 6-element BlockStored, 2-element BlockRemoved, AllBlocksCleared; "
        "no medium (device), lora_id copied to every block.",
        "msgspec from vllm#16750 structs (@b4e69e0a)",
    )
    vs.add(
        encode(V0Batch(TS, [V0Stored([11, 12], None, T8, 4, None), V0Stored([13], 12, [9, 10, 11, 12], 4, 5)])),
        seq=0, note="a root store and a LoRA child",
    )
    vs.add(encode(V0Batch(TS + 1, [V0Removed([13]), V0Cleared()])), seq=1, note="removal then clear")

    vs = vector_set(
        "vllm_medium_arrays",
        "vllm#19737: 7-element stores and 3-element removals with medium; 3-element batch.",
        "msgspec from vllm#19737 structs",
    )
    vs.add(
        encode(VBatch(TS, [
            V1Stored([21, 22], None, T8, 4, None, "GPU"),
            V1Stored([21, 22], None, T8, 4, None, "CPU"),
            V1Stored([23], 22, [9, 10, 11, 12], 4, None, None),
        ], 0)),
        seq=3, note="GPU, CPU (host copy) and a nil medium (device)",
    )
    vs.add(encode(VBatch(TS, [V1Removed([21, 22], "CPU"), V1Removed([23], "GPU")], 0)), seq=4)

    vs = vector_set(
        "vllm_lora_name_arrays",
        "vllm#27577: 8-element stores with lora_name; a child with no lora_name inherits the "
        "parent's; an empty lora_name counts as absent.",
        "msgspec from vllm#27577 structs",
    )
    vs.add(
        encode(VBatch(TS, [
            V2Stored([31], None, [1, 2, 3, 4], 4, 7, "GPU", "sql-adapter"),
            V2Stored([32], 31, [5, 6, 7, 8], 4, 7, "GPU", None),
            V2Stored([33], 32, [9, 10, 11, 12], 4, 7, "GPU", ""),
        ], 2)),
        seq=0, rank=2,
    )

    vs = vector_set(
        "vllm_extra_keys_arrays",
        "vllm#33304: 9-element stores with per-block extra_keys: text (cache salt on block 0), "
        "[identifier, offset] multimodal, bytes (prompt-embeds digest), int, and unmodelled shapes "
        "(float, nested) that are dropped from the proto; the salt skips the LoRA name.",
        "msgspec from vllm#33304 structs",
    )
    vs.add(
        encode(VBatch(TS, [
            V3Stored([41, 42], None, T8, 4, None, "GPU", None,
                     [["tenant-a", ["img0", 0]], [["img0", 4], b"\x01" * 32, 12345, 1.5, [1, 2, 3]]]),
            V3Stored([43], 42, [9, 10, 11, 12], 4, 2, "GPU", "lora-x", [["lora-x", "salt-b"]]),
            V3Stored([44], 43, [13, 14, 15, 16], 4, 2, "GPU", None, None),
            V3Stored([45], None, [1, 2, 3, 4], 4, None, "GPU", None, ["not-a-list"]),
        ], 0)),
        seq=0,
    )

    vs = vector_set(
        "vllm_group_idx_arrays",
        "vllm#37688: 10-element stores and 4-element removals with group_idx (a single group, "
        "which counts as main).",
        "msgspec from vllm#37688 structs",
    )
    vs.add(
        encode(VBatch(TS, [
            V4Stored([51], None, [1, 2, 3, 4], 4, None, "GPU", None, None, 0),
            V4Removed([51], "GPU", 0),
            V4Removed([52], "GPU", None),
        ], 1)),
        seq=0, rank=1,
    )

    vs = vector_set(
        "vllm_last_array_era",
        "vllm#40984 (<= v0.23): 12-element stores with kv_cache_spec_kind and sliding window; "
        "4-element removals.",
        "msgspec from vllm#40984 structs",
    )
    vs.add(
        encode(VBatch(TS, [
            V5Stored([61, 62], None, T8, 4, None, "GPU", None, [None, None], 0, "full_attention", None),
            V5Stored([63], 62, [9, 10, 11, 12], 4, None, "GPU", None, None, 0, "mla_attention", None),
            V4Removed([63], "GPU", 0),
            V0Cleared(),
        ], 0)),
        seq=0,
    )

    vs = vector_set(
        "vllm_map_events",
        "vLLM after #42892: tagged-map events (defaulted fields omitted, required nil written), "
        "with locality (#48281), ownership (#52067) and session_id (#51381).",
        "msgspec from vLLM main structs (map era)",
    )
    vs.add(
        encode(VBatch(TS, [
            VMStored([71, 72], None, T8, 4, None, "GPU", None, extra_keys=[None, None], group_idx=0,
                     kv_cache_spec_kind="full_attention", locality="LOCAL", session_id="sess-1"),
            VMStored([73], 72, [9, 10, 11, 12], 4, None, "GPU", None, locality="local",
                     ownership="tier2-agent"),
            VMRemoved([73], "GPU", group_idx=0, locality="LOCAL", ownership="tier2-agent"),
            VMStored([74], None, [1, 2, 3, 4], 4, None, "STORAGE", None, kv_cache_spec_sliding_window=4096),
            VMCleared(),
        ], 0)),
        seq=7,
    )

    vs = vector_set(
        "vllm_bytes_hashes",
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: 32-byte digests fold to their last 8 bytes "
        "big-endian (the int vLLM would send); short byte strings fold the same way; the parent too.",
        "msgspec, vLLM map structs",
    )
    vs.add(
        encode(VBatch(TS, [
            VMStored([DIGEST_A], None, [1, 2, 3, 4], 4, None, "GPU", None),
            VMStored([DIGEST_B], DIGEST_A, [5, 6, 7, 8], 4, None, "GPU", None),
            VMStored([b"\x00" * 24 + b"\x80" + b"\x00" * 7, b"\xff" * 8 + b"\xff" * 23 + b"\xfe"], None, T8, 4, None, "GPU", None),
            VMStored([b"\x01\x02"], None, [1, 2], 2, None, "GPU", None),
            VMRemoved([DIGEST_B, 0x1234], "GPU"),
        ], 0)),
        seq=0,
    )
    vs.add(
        encode(V0Batch(TS, [V0Stored([b"\x11" * 32], None, [1, 2, 3, 4], 4, None)])),
        seq=1, note="a #16750-shaped array with a bytes hash",
    )


# ----- gates ------------------------------------------------------------------


def gates() -> None:
    vs = vector_set(
        "unknown_event_tags",
        "Unknown tags (proposed BlockInactive / TierBlocksCleared, as maps and arrays) are dropped "
        "as unknown_type and still consume an event id.",
        "msgspec with proposed vllm#50732/#57296 structs",
    )
    vs.add(
        encode(VBatch(TS, [
            VMInactive([81], "GPU"),
            VMStored([81], None, [1, 2], 2, None, "GPU", None),
            V5Inactive([81], "CPU"),
            VMTierCleared("CPU"),
            VMRemoved([81], "GPU"),
        ], 0)),
        seq=0,
    )

    vs = vector_set(
        "kvcr_ownership",
        "ownership 'kvcr' (any case) is a residency agent: stores, removals and clears are "
        "dropped as unsupported_ownership; other owners are forwarded with their ownership.",
        "msgspec, vLLM map structs (+ a clear with ownership, as both SMG relays read it)",
    )
    vs.add(
        encode(VBatch(TS, [
            VMStored([91], None, [1, 2], 2, None, "GPU", None, ownership="kvcr"),
            VMRemoved([91], "GPU", ownership="KVCR"),
            VMClearedOwned(ownership="Kvcr"),
            VMStored([92], None, [1, 2], 2, None, "GPU", None, ownership="lmcache"),
            VMClearedOwned(ownership="lmcache"),
            VMClearedOwned(),
        ], 0)),
        seq=0,
    )

    vs = vector_set(
        "remote_locality",
        "locality REMOTE or any value but LOCAL (any case) is dropped as non_local_locality; "
        "absent and 'local' are admitted as LOCAL.",
        "msgspec, vLLM map structs (#48281)",
    )
    vs.add(
        encode(VBatch(TS, [
            VMStored([101], None, [1, 2], 2, None, "GPU", None, locality="REMOTE"),
            VMStored([102], None, [1, 2], 2, None, "GPU", None, locality="elsewhere"),
            VMRemoved([101], "GPU", locality="REMOTE"),
            VMStored([103], None, [1, 2], 2, None, "GPU", None, locality="local"),
            VMStored([104], None, [1, 2], 2, None, "GPU", None),
        ], 0)),
        seq=0,
    )

    media = ["GPU", "gpu", "DEVICE", "CPU", "CPU_PINNED", "cpu_tier1", "CPU_TIER2", "DISK", "NVME",
             "STORAGE", "EXTERNAL", "NETWORK", "REMOTE", "SHARED", "FS", "OBJ", "lmcache-l1", "MARS"]
    vs = vector_set(
        "media_tiers",
        "Every medium of the tier table (case-insensitive) with its cache_level; FS, OBJ, "
        "lmcache-l1 and MARS are unknown_medium; removals follow the same table.",
        "msgspec, vLLM map structs",
    )
    events = [VMStored([200 + i], None, [1, 2], 2, None, m, None) for i, m in enumerate(media)]
    events += [VMRemoved([200 + i], m) for i, m in enumerate(media)]
    vs.add(encode(VBatch(TS, events, 0)), seq=0)

    vs = vector_set(
        "hybrid_groups",
        "Hybrid model groups: full_attention, mla_attention and sink_full_attention are main; "
        "sliding_window and mamba are not and are dropped as non_main_attention_group on a rank "
        "with a main group; a kind-less event follows its learned group; an unknown group counts "
        "as main. The window store comes first, as the engines emit it.",
        "msgspec, vLLM map and array structs",
    )
    vs.add(
        encode(VBatch(TS, [
            VMStored([301], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=1,
                     kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4),
            VMStored([300, 301], None, T8, 4, None, "GPU", None, group_idx=0, kv_cache_spec_kind="full_attention"),
            V5Stored([302], None, [1, 2, 3, 4], 4, None, "GPU", None, None, 2, "mla_attention", None),
            VMStored([303], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=3, kv_cache_spec_kind="mamba"),
            VMStored([304], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=4, kv_cache_spec_kind="sink_full_attention"),
            VMStored([305], 301, [5, 6, 7, 8], 4, None, "GPU", None, group_idx=1),
            VMStored([306], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=7),
            VMRemoved([301], "GPU", group_idx=1),
            VMRemoved([303], "GPU", group_idx=3),
            VMRemoved([300], "GPU", group_idx=0),
        ], 0)),
        seq=0,
    )
    vs.add(
        encode(VBatch(TS + 1, [
            VMStored([307], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=1, kv_cache_spec_kind="sliding_window"),
            VMRemoved([307], "GPU", group_idx=1),
        ], 0)),
        seq=1, note="the groups learned in the first batch still apply",
    )

    vs = vector_set(
        "placeholders_unaligned_selfref",
        "Store shape gates: placeholders (no tokens or no hashes, e.g. vLLM CPU-offload chunk "
        "keys with block_size 0), unaligned spans (not tail-alignable either), block_size <= 0 or "
        ">= 2^31, self-referencing hashes (repeated, or equal to the parent).",
        "msgspec, vLLM map and array structs",
    )
    vs.add(
        encode(VBatch(TS, [
            VMStored([401], None, [], 0, None, "CPU", None),
            VMStored([], None, [1, 2, 3, 4], 4, None, "GPU", None),
            VMStored([402, 403], None, [1, 2, 3, 4, 5, 6, 7], 4, None, "GPU", None),
            VMStored([404, 405, 406], None, T8, 4, None, "GPU", None),
            VMStored([407], None, [1, 2, 3, 4], 0, None, "GPU", None),
            VMStored([408], None, [1, 2, 3, 4], -4, None, "GPU", None),
            VMStored([409], None, [1, 2, 3, 4], 1 << 31, None, "GPU", None),
            VMStored([410, 411, 410], None, [1, 2, 3, 4, 5, 6], 2, None, "GPU", None),
            VMStored([412], 412, [1, 2], 2, None, "GPU", None),
            V1Stored([413], None, [1, 2, 3], 4, None, "GPU"),
            VMStored([414], None, [1, 2], 2, None, "GPU", None),
        ], 0)),
        seq=0,
    )

    vs = vector_set(
        "malformed_events",
        "A known event with an unreadable required field is dropped as malformed and costs only "
        "itself: non-hash hashes (text, bool), a missing block_size or token_ids, a non-integer "
        "block_size, out-of-range or mixed bigram token cells, a non-event, a missing or "
        "non-text tag.",
        "hand-built msgpack (msgspec-encoded dicts and lists)",
    )
    good = VMStored([501], None, [1, 2], 2, None, "GPU", None)
    base = {"type": "BlockStored", "block_hashes": [502], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}

    def variant(**changes):
        out = dict(base)
        for key, value in changes.items():
            if value is ...:
                out.pop(key)
            else:
                out[key] = value
        return out

    vs.add(
        encode(VBatch(TS, [
            variant(block_hashes=["x"]),
            variant(block_hashes=[True]),
            variant(block_hashes=...),
            variant(block_size=...),
            variant(block_size=2.0),
            variant(token_ids=...),
            variant(token_ids=[1, -2]),
            variant(token_ids=[1, 1 << 32]),
            variant(token_ids=[1, [2, 3]]),
            variant(token_ids=[[1, 2, 3], [2, 3, 4]]),
            {"type": "BlockRemoved", "block_hashes": "abc", "medium": "GPU"},
            {"block_hashes": [503]},
            {"type": 5},
            [5, [503]],
            [],
            7,
            good,
        ], 0)),
        seq=0,
    )

    vs = vector_set(
        "scalar_coercion",
        "Optional scalars of the wrong type read as absent, not malformed: a non-text medium "
        "(device), kind, locality (LOCAL), ownership, session_id, lora_name; a negative or "
        "non-integer group_idx or window; a non-integer lora_id; a non-hash parent.",
        "hand-built msgpack maps",
    )
    vs.add(
        encode(VBatch(TS, [
            dict(base, block_hashes=[601], medium=5, kv_cache_spec_kind=7, locality=1, ownership=2,
                 session_id=b"s", lora_name=3, group_idx=-1, kv_cache_spec_sliding_window="big",
                 lora_id="3", parent_block_hash="p"),
            dict(base, block_hashes=[602], group_idx=1 << 32, kv_cache_spec_sliding_window=-4, lora_id=-9,
                 extra_keys="nope", unknown_future_key={"a": 1}),
        ], 0)),
        seq=0,
    )


# ----- state ------------------------------------------------------------------


def base_stored_map() -> dict:
    """A minimal vLLM map-era BlockStored as a plain dict, for hand-made variants."""
    return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}


def state() -> None:
    vs = vector_set(
        "namespace_inheritance",
        "lora_name and cache_salt (vLLM: first text extra key of block 0 that is not the LoRA "
        "name) are inherited from the parent's record on the same rank and tier, down "
        "generations; another rank, another tier, or a parent whose last copy was removed gives "
        "nothing; a re-store of known hashes is forwarded (a duplicate).",
        "msgspec, vLLM map structs",
    )
    vs.add(encode(VBatch(TS, [VMStored([701], None, [1, 2], 2, 1, "GPU", "ad", extra_keys=[["ad", "tenant-a"]])], 0)), seq=0)
    vs.add(encode(VBatch(TS, [VMStored([702], 701, [3, 4], 2, None, "GPU", None)], 0)), seq=1)
    vs.add(encode(VBatch(TS, [VMStored([703], 702, [5, 6], 2, None, "GPU", None)], 0)), seq=2)
    vs.add(encode(VBatch(TS, [VMStored([704], 701, [3, 4], 2, None, "GPU", None)], 1)), seq=0, rank=1,
           note="rank 1 does not inherit rank 0's record")
    vs.add(encode(VBatch(TS, [VMStored([705], 701, [3, 4], 2, None, "CPU", None)], 0)), seq=3,
           note="the host tier does not inherit the device record")
    vs.add(encode(VBatch(TS, [
        VMStored([701], None, [1, 2], 2, None, "GPU", None, extra_keys=[["tenant-b"]]),
        VMRemoved([701], "GPU"),
        VMStored([706], 701, [3, 4], 2, None, "GPU", None),
        VMRemoved([701], "GPU"),
        VMStored([707], 701, [3, 4], 2, None, "GPU", None),
        VMStored([702, 703], 701, [3, 4, 5, 6], 2, None, "GPU", None),
    ], 0)), seq=4, note="a second copy overwrites the namespace; the record goes with the last copy; "
                         "a store of known hashes is a duplicate, still forwarded")

    vs = vector_set(
        "clear_resets_rank",
        "AllBlocksCleared erases only its rank's records: afterwards that rank's children inherit "
        "nothing; the other rank's still do.",
        "msgspec, SGLang map structs",
    )
    vs.add(encode(SBatch(TS, [SMStored([801], None, [1, 2], 2, None, cache_salt="s0")], 0)), seq=0, rank=0)
    vs.add(encode(SBatch(TS, [SMStored([801], None, [1, 2], 2, None, cache_salt="s1")], 1)), seq=0, rank=1)
    vs.add(encode(SBatch(TS, [SMCleared(), SMStored([802], 801, [3, 4], 2, None)], 0)), seq=1, rank=0)
    vs.add(encode(SBatch(TS, [SMStored([802], 801, [3, 4], 2, None)], 1)), seq=1, rank=1)

    # relay-semantics.md §7.9, the Python relay's own unit tests, as vectors.
    vs = vector_set(
        "python_relay_unit_cases",
        "test_hashes_fold_like_the_engines_send_them (7, 2^63, 2^64-1, -3, bytes), "
        "test_unknown_keys_and_bigram_cells_decode_and_a_bad_event_costs_itself (unknown keys "
        "skipped, a bigram store, a malformed and an unknown event each consume an id), test_socket_rank_wins_over_the_payload_rank (payload 0 on socket 3).",
        "relay-semantics.md §7.9 (grpc_servicer/tests/test_kv_relay.py @84258829)",
    )
    vs.add(encode(VBatch(TS, [VMStored([7, 1 << 63, (1 << 64) - 1, -3, b"\x99" * 4 + b"\x80" + b"\x00" * 6 + b"\x05"], None,
                                       list(range(10)), 2, None, "GPU", None)], 0)), seq=0, rank=0)
    vs.add(encode(VBatch(TS, [
        dict(base_stored_map(), block_hashes=[1501], token_ids=[[1, 2], [2, 3]], future_key=[1, {"x": None}]),
        dict(base_stored_map(), block_hashes=[1502], block_size="two"),
        {"type": "BlockEvicted", "block_hashes": [1501]},
        {"type": "BlockRemoved", "block_hashes": [1501], "medium": "GPU", "another_future_key": 1},
    ], 0)), seq=1, rank=0)
    vs.add(encode(VBatch(TS, [VMCleared()], 0)), seq=2, rank=3, note="payload rank 0 on socket 3")

    vs = vector_set(
        "envelopes",
        "Batch envelopes: [ts, events] (no rank), [ts, events, rank] with a nil rank, trailing "
        "future elements ignored, an integer ts, an empty event list. The socket's rank is what "
        "the batch carries (the payload's rank never wins).",
        "hand-built msgpack",
    )
    vs.add(encode([TS, []]), seq=0, rank=0, note="2-element envelope")
    vs.add(encode([TS, [], None]), seq=1, rank=0, note="nil rank")
    vs.add(encode([TS, [], 2, "future"]), seq=2, rank=0, note="trailing element; payload rank 2 loses to socket rank 0")
    vs.add(encode([17, [VMCleared()], 0]), seq=3, rank=3, note="integer ts; socket rank 3")
    vs.add(encode(VBatch(TS, [V0Stored([901], None, [1, 2], 2, None)], 5)), seq=(1 << 64) - 2, rank=5,
           note="a sequence near the top of uint64")
    vs.add(encode([TS, [], 2]), seq=5, rank=-1, note="no socket rank: the payload's rank 2 is carried")
    vs.add(encode([TS, [], None]), seq=6, rank=-1, note="no socket rank and a nil payload rank: no dp_rank")
    vs.add(encode([TS, []]), seq=7, rank=-1, note="no socket rank, no payload rank: no dp_rank")

    vs = vector_set(
        "undecodable_envelopes",
        "Payloads that are not a batch: each is an error (wire.ErrUndecodable), never a panic.",
        "hand-built bytes",
    )
    good_payload = encode(VBatch(TS, [VMStored([911], None, [1, 2], 2, None, "GPU", None)], 0))
    for i, (payload, note) in enumerate([
        (b"", "empty payload"),
        (encode(5), "an integer, not an array"),
        (encode("batch"), "a string"),
        (encode([TS]), "a 1-element array"),
        (encode([TS, 5, 0]), "events is not an array"),
        (good_payload[:-1], "truncated by one byte"),
        (good_payload[:20], "truncated inside the first event"),
        (bytes([0x93, 0xc1, 0x90, 0x00]), "the reserved byte 0xc1"),
    ]):
        vs.add(payload, seq=i, rank=0, note=note)


# ----- intended differences from the Python relay ------------------------------


def differences() -> None:
    vs = vector_set(
        "tail_aligned_stores",
        "Rust-style tail alignment: a store with fewer hashes than its span, the span a whole "
        "number of blocks, keeps the last hashes x block_size tokens (sliding-window stores). "
        "The Python relay drops these as unaligned_blocks.",
        "msgspec, vLLM map structs",
    )
    payload = encode(VBatch(TS, [
        VMStored([1001], None, T8, 4, None, "GPU", None),
        VMStored([1002, 1003], 1001, list(range(1, 13)), 4, None, "GPU", None),
        VMStored([1004], None, [1, 2, 3, 4, 5, 6], 4, None, "GPU", None),
    ], 0))
    ours = batch(0, TS, 0, [
        stored(1, [(1001, [5, 6, 7, 8])], medium="GPU"),
        stored(2, [(1002, [5, 6, 7, 8]), (1003, [9, 10, 11, 12])], parent=1001, medium="GPU"),
    ])
    vs.add(
        payload, seq=0, ours=(ours, {"unaligned_blocks": 1}),
        differs="kvrelay tail-aligns like the Rust relay (kv_wire.rs); Python has no tail "
        "alignment. The third store (6 tokens, block size 4) is unaligned in both.",
    )

    vs = vector_set(
        "window_only_rank",
        "Rust-style window-only forwarding: a rank whose only groups are sliding-window forwards "
        "their stores and remembers the hashes, so their removals pass; once the rank has a main "
        "group, window events are dropped, except removals of hashes forwarded while window-only "
        "(only those hashes are kept). The Python relay drops every non-main event.",
        "msgspec, vLLM map structs",
    )
    win = dict(group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8)
    differs = "kvrelay forwards a window-only rank's groups like the Rust relay; Python drops every non-main event"
    vs.add(
        encode(VBatch(TS, [VMStored([1101, 1102], None, T8, 4, None, "GPU", None, **win)], 0)),
        seq=0,
        ours=(batch(0, TS, 0, [stored(1, [(1101, [1, 2, 3, 4]), (1102, [5, 6, 7, 8])], medium="GPU", **win)]), {}),
        differs=differs,
    )
    vs.add(
        encode(VBatch(TS, [VMRemoved([1101], "GPU", group_idx=1)], 0)),
        seq=1,
        ours=(batch(1, TS, 0, [removed(2, [1101], medium="GPU", group_idx=1)]), {}),
        differs=differs + " (a kind-less removal follows its learned window group)",
    )
    vs.add(
        encode(VBatch(TS, [VMStored([1201], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=0,
                                    kv_cache_spec_kind="full_attention")], 0)),
        seq=2, note="a main group appears: both relays forward it",
    )
    vs.add(
        encode(VBatch(TS, [VMStored([1103], 1102, [9, 10, 11, 12], 4, None, "GPU", None, **win)], 0)),
        seq=3, note="a window store on a rank with a main group: dropped by both",
    )
    vs.add(
        encode(VBatch(TS, [VMRemoved([1102, 1103], "GPU", group_idx=1), VMRemoved([1103], "GPU", group_idx=1)], 0)),
        seq=4,
        ours=(batch(4, TS, 0, [removed(5, [1102], medium="GPU", group_idx=1)]), {"non_main_attention_group": 1}),
        differs=differs + " (a window removal on a rank that now has a main group keeps only the "
        "hashes forwarded while window-only; with none of them it is dropped)",
    )


# ----- public golden bytes (engine-wire.md §5) -----------------------------------

F1_BATCH1 = (
    "93cb41d954fc402000009588a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c4200000000000000000000000000000000000000000000000008000000000000000c420000000000000000000000000000000000000000000000000fffffffffffffffeb1706172656e745f626c6f636b5f6861736807a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c08aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cd1234b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647392090aaa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756dc0a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e88a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739105b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647393010203aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cd1234c420ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffa66d656469756da347505581a474797065b0416c6c426c6f636b73436c6561726564c0"
)
F1_BATCH2 = (
    "93cb41d954fc404000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573912ab1706172656e745f626c6f636b5f6861736829a9746f6b656e5f696473926465aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c001"
)
F2 = (
    "93cb41daad390224a3199187a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3e0c3dfcd8eacb368cf7fde5eb5b613d806b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0080cd0348cd5124cd04decd0108cd108dcdad5acd0739cd349dcd0108cd04accd0691cd01f8cd48d7cd0137cd261b0dcded71cd0691cd71820bcd0357cd1d870bce00014aa8cd8f48cd25d80bcd41ff0bcd2927cd079ccd1ca90bcd0143cd04decd0117cd0636cd07f1cd0176cd17270dcd1c71cd188ecd0468cd217dcd03d3cd1480cd1cdccd43b3ce000130cacd0143cd04decd0117cd0739cd6bebcd037ccd2e58cd04f1cd075acd0719cd06910dce00013ffdcd0117cd086bcd44dccd013bcd01a3cd075acd0143cd0117cd199fcdf9c3cd0749cd079ccd04510dcd07decd0dcfcd04decd0108cd108dcdad5acd0739cd349dcd0108cd04accd0691cd01f8cd48d7cd0137cd261b0bcd0246cd04a0cd0137cd0b5ccd0117cd0a8dcd44dc19cd0691cd71820bcd0357cd1d870bce00014aa8cd8f48cd25d80bcd41ff0bcd2927cd079ccd1ca90bcd0143cd348bcd0117cd0636cd07f1cd0137cd0117cd04accd017e100daa626c6f636b5f73697a6540a76c6f72615f6964c0a66d656469756da347505500"
)
F5 = (
    "93cb3ff40000000000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573912ab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573912aa66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656403"
)
F6_LEGACY = "93cb41da39de002000009297ab426c6f636b53746f7265649221222092010210c0a347505593ac426c6f636b52656d6f7665649122a753544f52414745c0"
F8 = "93cb405edd2f1a9fbe779187a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf0000011f71fb04cbd2c521974fb1706172656e745f626c6f636b5f686173682aa9746f6b656e5f696473940a141e28aa626c6f636b5f73697a6504a76c6f72615f696407a66d656469756da347505502"
F9 = "93cb41d954fc402000009197ab426c6f636b53746f72656491c4200101010101010101010101010101010101010101010101010101010101010101c0940102030404c0aa6c6d63616368652d6c31c0"


def public_golden() -> None:
    vs = vector_set(
        "f1_smg_golden_vllm_0_30_1rc1",
        "smg's golden vLLM 0.30.1rc1 batches (kv_events.rs @4d9a177b): BATCH1 at seq 9 (bytes-hash "
        "stores, an unaligned store, an int-hash store with group/kind, a mixed removal, a clear), "
        "BATCH2 at seq 10 on rank 1. relay-semantics.md §7.1 item 3.",
        "engine-wire.md §5 F1",
    )
    # Socket rank -1 (unknown): the payload's rank is carried, as the Rust
    # relay's test expects it (BATCH1 nil, BATCH2 1).
    p1, _ = vs.add(bytes.fromhex(F1_BATCH1), seq=9, rank=-1,
                   note="payload rank nil and no socket rank: no dp_rank")
    # relay-semantics §7.1 item 3, checked against the oracle's output.
    check(event_ids(p1) == [1, 2, 4, 5], f"F1 BATCH1 ids {event_ids(p1)}")
    s1 = p1.events[0].stored
    check(s1.parent_block_hash == 7 and [b.block_hash for b in s1.blocks] == [-(1 << 63), -2], "F1 store 1")
    check([list(b.token_ids) for b in s1.blocks] == [[1, 2, 3, 4], [5, 6, 7, 8]], "F1 store 1 tokens")
    s2 = p1.events[1].stored
    check([b.block_hash for b in s2.blocks] == [0x1234] and list(s2.blocks[0].token_ids) == [9, 10]
          and s2.blocks[0].lora_id == 3, "F1 store 2")
    r = p1.events[2].removed
    check(list(r.block_hashes) == [0x1234, -1] and r.tier == DEVICE and r.medium == "GPU"
          and r.locality == LOCAL and not r.HasField("cache_level"), "F1 removal")
    check(p1.events[3].HasField("cleared") and p1.timestamp == 1700000000.5
          and not p1.HasField("dp_rank"), "F1 clear, ts, rank")
    p2, _ = vs.add(bytes.fromhex(F1_BATCH2), seq=10, rank=-1)
    check(event_ids(p2) == [6] and p2.dp_rank == 1 and p2.events[0].stored.parent_block_hash == 41
          and p2.events[0].stored.blocks[0].block_hash == 42, "F1 BATCH2")

    vs = vector_set("f2_sglang_capture", "Real SGLang capture (llm-d-router sglang_adapter_test): two "
                    "64-token blocks, signed (d3) and unsigned (cf) hashes, medium GPU, rank 0.",
                    "engine-wire.md §5 F2")
    p, _ = vs.add(bytes.fromhex(F2), seq=0, rank=0)
    check([b.block_hash for b in p.events[0].stored.blocks] == [-2250709314800143512, 9213906022183458822], "F2 hashes")
    vs = vector_set("f5_vllm_msgspec_fixture", "A canonical vLLM msgspec fixture: ts 1.25, map store [42] "
                    "with group 0, removal with group 0, clear, rank 3.", "engine-wire.md §5 F5")
    vs.add(bytes.fromhex(F5), seq=0, rank=3)
    vs = vector_set("f6_vllm_legacy", "vLLM legacy arrays (7-element store with parent 32 whose 2 tokens do "
                    "not fill 2 blocks of 16, 3-element STORAGE removal), nil rank.", "engine-wire.md §5 F6")
    vs.add(bytes.fromhex(F6_LEGACY), seq=0, rank=0)
    vs = vector_set("f8_sglang_map_golden", "SGLang map batch: hashes [1234567890123 (cf), -987654321 (d2)], "
                    "parent 42, lora 7, 4 tokens with block size 4 (2 hashes: unaligned), rank 2.",
                    "engine-wire.md §5 F8")
    vs.add(bytes.fromhex(F8), seq=0, rank=2)
    vs = vector_set("f9_vllm_lmcache", "Legacy vLLM array with a 32-byte hash and medium lmcache-l1 "
                    "(unknown_medium).", "engine-wire.md §5 F9")
    vs.add(bytes.fromhex(F9), seq=0, rank=0)


# ----- SGLang and TokenSpeed eras ---------------------------------------------------


def sglang_tokenspeed() -> None:
    vs = vector_set(
        "sglang_oldest_arrays",
        "SGLang @006d053f: 2-element batch, 6-element stores, 2-element removals, a startup clear; "
        "signed hashes.",
        "msgspec from sglang @006d053f structs",
    )
    vs.add(encode(S0Batch(TS, [S0Cleared(), S0Stored([S_A, S_B], None, T8, 4, None), S0Stored([-5], S_B, [9, 9, 9, 9], 4, None)])), seq=0)
    vs.add(encode(S0Batch(TS, [S0Removed([-5, S_B])])), seq=1)

    vs = vector_set(
        "sglang_medium_arrays",
        "sglang#18205: 7-element stores and 3-element removals with the media GPU, CPU_TIER1, "
        "CPU_TIER2 and a nil medium; batch with attn_dp_rank.",
        "msgspec from sglang#18205 structs",
    )
    vs.add(encode(SBatch(TS, [
        S1Stored([S_A], None, [1, 2, 3, 4], 4, None, "GPU"),
        S1Stored([S_A], None, [1, 2, 3, 4], 4, None, "CPU_TIER1"),
        S1Stored([S_A], None, [1, 2, 3, 4], 4, None, "CPU_TIER2"),
        S1Stored([S_B], S_A, [5, 6, 7, 8], 4, None, None),
        S1Removed([S_A], "CPU_TIER1"),
        S1Removed([S_B]),
    ], 1)), seq=0, rank=1)

    vs = vector_set(
        "sglang_map_events",
        "sglang#37482: tagged maps with cache_salt and session_id; a child inherits the salt; "
        "removal and clear maps.",
        "msgspec from sglang#37482 structs",
    )
    vs.add(encode(SBatch(TS, [
        SMCleared(),
        SMStored([SALT_A, SALT_B], None, T8, 4, None, medium="GPU", cache_salt="tenant-a", session_id="sess-9"),
        SMStored([-77], SALT_B, [9, 10, 11, 12], 4, None, medium="GPU"),
        SMStored([-78], None, [1, 2, 3, 4], 4, None, medium="DISK", cache_salt=""),
        SMRemoved([SALT_B], medium="GPU"),
        SMRemoved([-78], medium="DISK"),
    ], 0)), seq=0)

    vs = vector_set(
        "sglang_bigram_tokens",
        "SGLang under EAGLE: token_ids as [token, next] bigram cells fold to their first word; "
        "plain and bigram cells mixed, or a 3-word cell, are malformed.",
        "msgspec, SGLang array and map structs",
    )
    bigrams = [[1, 2], [2, 3], [3, 4], [4, 5]]
    vs.add(encode(SBatch(TS, [
        S1Stored([-638950109823820341], None, bigrams, 4, None, "GPU"),
        SMStored([-638950109823820342, 63895010982382034], None, bigrams + [[5, 6], [6, 7], [7, 8], [8, 9]], 4, None),
        SMStored([-1], None, [1, [2, 3], 3, 4], 4, None),
    ], 0)), seq=0)

    vs = vector_set(
        "tokenspeed_batches",
        "TokenSpeed @d8e54692: 5-element stores (no lora_id, no medium: device tier), "
        "2-element removals, unsigned hashes including values above 2^63-1; the F4 test shape.",
        "msgspec from tokenspeed structs; engine-wire.md §3.5 F4",
    )
    f4 = encode(TBatch(1.5, [TStored([123], None, [1, 2], 2), TRemoved([123])], 2))
    check(msgspec.msgpack.decode(f4) == [1.5, [["BlockStored", [123], None, [1, 2], 2], ["BlockRemoved", [123]]], 2],
          "TokenSpeed F4 shape")
    vs.add(f4, seq=0, rank=2, note="test_kv_event_batch_msgpack_shape_is_dynamo_compatible")
    vs.add(encode(TBatch(TS, [
        TStored([15932823548972441343], None, [1, 2, 3, 4], 4),
        TStored([12482753192408519678], 15932823548972441343, [5, 6, 7, 8], 4),
        TRemoved([12482753192408519678]),
    ], 2)), seq=1, rank=2, note="FNV-1a chain (§4.3) with parent")


def main() -> int:
    for old in OUT.glob("*.json"):
        old.unlink()
    worked_encodings()
    vllm_eras()
    gates()
    state()
    differences()
    public_golden()
    sglang_tokenspeed()
    names = [vs.name for vs in SETS]
    if len(names) != len(set(names)):
        raise SystemExit("duplicate vector set names")
    for vs in SETS:
        vs.write()
    payloads = sum(len(vs.payloads) for vs in SETS)
    print(f"wrote {len(SETS)} vector sets, {payloads} payloads, to {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
