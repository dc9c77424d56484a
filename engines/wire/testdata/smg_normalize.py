"""Oracle for engines/wire: normalize batches with smg's Python relay.

Reads one JSON request per line ({"payload": hex, "seq": int, "rank": int|null})
and feeds them, in order, to one smg_grpc_servicer.kv_relay.Normalizer; writes
one JSON line per batch: {"proto": hex of the serialized KvEventBatch,
"dropped": {reason: cumulative count}}. A request {"reset": true} starts a
fresh Normalizer and gets no answer.
"""

import json
import sys

from smg_grpc_servicer.kv_relay import Normalizer, decode_batch


def main() -> None:
    normalizer = Normalizer()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("reset"):
            normalizer = Normalizer()
            continue
        batch = decode_batch(bytes.fromhex(request["payload"]))
        proto = normalizer.normalize_batch(batch, request["seq"], request["rank"])
        print(json.dumps({"proto": proto.SerializeToString().hex(), "dropped": normalizer.counts.dropped}))


if __name__ == "__main__":
    main()
