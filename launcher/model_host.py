"""The launcher's ModelHost service (proto/model_host.proto), which the router calls.

What the router asks of it to pull, start and stop models, and to pull LoRA adapters. It runs in
gRPC's worker threads beside the supervisor's watch loop; the shard groups it starts are the
supervisor's to watch once they listen."""
from __future__ import annotations

import queue
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Protocol

import grpc

from launcher.config import LauncherConfig
from launcher.local_roots import pull_roots
from launcher.model_cache import ModelResolutionError
from launcher.prepare import conversion_dtype
from launcher.pull import pull, pull_adapter
from launcher.shard_group import LaunchError
from proto import model_host_pb2 as pb
from proto import model_host_pb2_grpc as pb_grpc


class GroupHost(Protocol):
    """What the service needs of the supervisor (launcher/supervisor.py).

    Named here so that the two modules do not import each other."""
    config: LauncherConfig

    def start_group(self, name: str, model_dir: Path, *, num_shard: int, dtype: str,
                    device: str, cpu_threads: int = 0) -> str: ...

    def stop_group(self, name: str) -> None: ...

    def group_names(self) -> list[str]: ...

MAX_PULLS = 4  # the router's limit too (router/lifecycle/pulls.py)
_PROGRESS_INTERVAL = 0.2  # seconds between two progress messages of one pull


class ModelHostService(pb_grpc.ModelHostServicer):
    def __init__(self, supervisor: GroupHost):
        self.supervisor = supervisor
        self.local_roots = pull_roots(supervisor.config)  # where a pull may read local files

    def Pull(self, request, context):
        updates: queue.Queue = queue.Queue()
        outcome: dict = {}

        def progress(stage: str, done: int, total: int) -> None:
            updates.put((stage, done, total))

        def work() -> None:
            try:
                config = self.supervisor.config
                if request.adapter:  # its files as they are: nothing to convert
                    outcome["pulled"] = pull_adapter(
                        request.source, Path(request.target_dir), progress,
                        revision=request.revision or None,
                        hub_cache=config.huggingface_hub_cache, max_bytes=request.max_bytes)
                else:
                    outcome["pulled"] = pull(
                        request.source, Path(request.target_dir), progress,
                        revision=request.revision or None,
                        hub_cache=config.huggingface_hub_cache,
                        # as the launcher's own model: what its flags serve (a model started
                        # later with another dtype is served from this conversion all the same)
                        convert_dtype=conversion_dtype(config.dtype, config.shard_quantize),
                        allowed=self.local_roots)
            except (ModelResolutionError, ValueError, OSError) as err:
                outcome["error"] = str(err)
            except Exception as err:  # a converter bug is this pull's failure, not the launcher's
                outcome["error"] = f"{type(err).__name__}: {err}"
            finally:
                updates.put(None)

        threading.Thread(target=work, name=f"pull {request.source}", daemon=True).start()
        last_sent = 0.0
        while (update := updates.get()) is not None:
            stage, done, total = update
            now = time.monotonic()
            if now - last_sent >= _PROGRESS_INTERVAL or done >= total:
                last_sent = now
                yield pb.PullProgress(stage=stage, bytes_done=done, bytes_total=total)
        if "error" in outcome:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, outcome["error"])
        pulled = outcome["pulled"]
        yield pb.PullProgress(done=True, bytes_done=pulled.size_bytes,
                              bytes_total=pulled.size_bytes, format=pulled.format,
                              quantization=pulled.quantization, size_bytes=pulled.size_bytes)

    def StartGroup(self, request, context):
        try:
            socket = self.supervisor.start_group(
                request.name, Path(request.model_dir), num_shard=request.num_shard or 1,
                dtype=request.dtype or self.supervisor.config.dtype,
                device=request.device or self.supervisor.config.device,
                cpu_threads=request.cpu_threads)
        except LaunchError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return pb.StartGroupResponse(master_uds_path=socket)

    def StopGroup(self, request, context):
        self.supervisor.stop_group(request.name)
        return pb.StopGroupResponse()

    def Groups(self, request, context):
        return pb.GroupsResponse(names=sorted(self.supervisor.group_names()))


def serve(supervisor: GroupHost, socket_path: str) -> grpc.Server:
    # a Pull holds its worker for the whole download: the router runs at most MAX_PULLS at once,
    # so that StartGroup and StopGroup always find a free worker
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_PULLS + 8,
                                                    thread_name_prefix="model-host"))
    pb_grpc.add_ModelHostServicer_to_server(ModelHostService(supervisor), server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server
