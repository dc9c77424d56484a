"""A vLLM engine servicer's load reporting, both ways, with SMG's own code:
GetLoads answers and the load records SMG's relay pushes on its KV-event
stream, from one scripted load, so a gateway test can see which one it
reads.

SubscribeKvEvents is `smg_grpc_servicer.kv_relay.relay` (as in
py_relay_server.py) with a load source that maps the scripted SchedulerLoad
by `load_record.engine_load_from`, as the servicer does; GetLoads returns the
same SchedulerLoad in smg_grpc_proto's message.

Usage: py_loads_servicer.py --endpoint tcp://127.0.0.1:P [--replay-endpoint R]
       [--dp-size N] [--port 0] --loads-file PATH
The file holds {"push": bool, "ranks": {"RANK": {SchedulerLoad fields}}},
reread on every call: "push": false makes the load source answer None (no
record, SMG's "unknown"), so the stream stops pushing while GetLoads goes on.
Prints {"ready": true, "port": N} once it listens, then {"call": "GetLoads"}
for every GetLoads call.
"""

import json

from smg_grpc_proto.generated import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as pbg
from smg_grpc_servicer import kv_relay, load_record

import relay_peer


def main_args():
    ap = relay_peer.parser()
    ap.add_argument("--loads-file", required=True)
    return ap.parse_args()


def read(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return False, {}
    ranks = {int(r): pb.SchedulerLoad(dp_rank=int(r), **fields) for r, fields in doc.get("ranks", {}).items()}
    return bool(doc.get("push")), ranks


async def main() -> int:
    a = main_args()
    sources = relay_peer.rank_sources(a)

    def load_source(rank):
        push, ranks = read(a.loads_file)
        load = ranks.get(rank or 0)
        if not push or load is None:
            return None
        return load_record.engine_load_from(load, queued_token_work=True)

    class Servicer(pbg.VllmEngineServicer):
        async def SubscribeKvEvents(self, request, context):
            async for batch in kv_relay.relay(sources, kv_relay.Engine.VLLM, request.start_sequence_number,
                                              context, load_source=load_source):
                yield batch

        async def GetLoads(self, request, context):
            print(json.dumps({"call": "GetLoads"}), flush=True)
            _, ranks = read(a.loads_file)
            loads = [ranks[r] for r in sorted(ranks)]
            return pb.GetLoadsResponse(dp_rank_count=len(loads), loads=loads)

    return await relay_peer.serve(pbg.add_VllmEngineServicer_to_server, Servicer(), a.port)


if __name__ == "__main__":
    relay_peer.run(main)
