"""An engine servicer answering GetLoads, for engines/load's GetLoads source.

It serves one engine's GetLoads (vllm, sglang or tokenspeed) with SMG's own
generated messages (smg_grpc_proto), a report per DP rank with every field
set, and prints one JSON line: the port, and per rank the EngineLoad that
smg-grpc-servicer's own conversion (load_record.engine_load_from, with the
queued-work flag each engine's servicer passes) makes of the same report, as
hex protobuf. The Go test reads the same report through kvrelay's source and
compares the records field by field.

Usage: getloads_servicer.py --engine vllm|sglang|tokenspeed
"""

import argparse
import json
import sys
import time
from concurrent import futures

import grpc
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2 as sg,
    sglang_scheduler_pb2_grpc as sgg,
    tokenspeed_scheduler_pb2 as ts,
    tokenspeed_scheduler_pb2_grpc as tsg,
    vllm_engine_pb2 as vl,
    vllm_engine_pb2_grpc as vlg,
)
from smg_grpc_servicer.load_record import engine_load_from


def reports(engine):
    out = []
    for rank in (0, 1):
        common = dict(
            dp_rank=rank, num_running_reqs=3 + rank, num_waiting_reqs=2 * rank, num_total_reqs=3 + 3 * rank,
            num_used_tokens=1000 + rank, max_total_num_tokens=65536, token_usage=0.125 + rank / 4,
            gen_throughput=750.5, cache_hit_rate=0.375, utilization=0.5, max_running_requests=256,
            num_waiting_uncached_tokens=77 + rank,
        )
        if engine == "vllm":
            out.append(vl.SchedulerLoad(**common))
        elif engine == "sglang":
            load = sg.SchedulerLoad(**common)
            if rank == 0:  # rank 1 leaves the sections out
                load.memory.CopyFrom(sg.MemoryMetrics(weight_gb=1.5, kv_cache_gb=6.25, graph_gb=0.5, token_capacity=65536))
                load.speculative.CopyFrom(sg.SpeculativeMetrics(accept_length=2.5, accept_rate=0.75))
                load.lora.CopyFrom(sg.LoRAMetrics(slots_used=1, slots_total=8, utilization=0.125))
                load.disaggregation.CopyFrom(sg.DisaggregationMetrics(mode="decode", decode_prealloc_queue_reqs=3, kv_transfer_speed_gb_s=9.5))
                load.queues.CopyFrom(sg.QueueMetrics(waiting=2, grammar=1, paused=0, retracted=4))
            out.append(load)
        else:
            load = ts.SchedulerLoad(**common)
            if rank == 0:
                load.active_token_usage = 0.0625
                load.memory.CopyFrom(ts.MemoryMetrics(weight_gb=2.0, kv_cache_gb=4.0, graph_gb=0.25, token_capacity=32768))
                load.queues.CopyFrom(ts.QueueMetrics(waiting=1))
            out.append(load)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True, choices=["vllm", "sglang", "tokenspeed"])
    a = ap.parse_args()
    loads = reports(a.engine)
    mod, grpc_mod, servicer, add = {
        "vllm": (vl, vlg, vlg.VllmEngineServicer, vlg.add_VllmEngineServicer_to_server),
        "sglang": (sg, sgg, sgg.SglangSchedulerServicer, sgg.add_SglangSchedulerServicer_to_server),
        "tokenspeed": (ts, tsg, tsg.TokenSpeedSchedulerServicer, tsg.add_TokenSpeedSchedulerServicer_to_server),
    }[a.engine]

    class Servicer(servicer):
        def GetLoads(self, request, context):
            return mod.GetLoadsResponse(timestamp="now", version="test", dp_rank_count=len(loads), loads=loads)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # The queued-work flag as each engine's servicer passes it (vllm and
    # sglang loads.py: True; tokenspeed loads.py: False).
    queued = a.engine != "tokenspeed"
    want = {str(l.dp_rank): engine_load_from(l, queued_token_work=queued).SerializeToString().hex() for l in loads}
    sys.stdout.write(json.dumps({"ready": True, "port": port, "want": want}) + "\n")
    sys.stdout.flush()
    try:
        sys.stdin.read()  # until the test closes stdin
    finally:
        server.stop(0)


if __name__ == "__main__":
    main()
