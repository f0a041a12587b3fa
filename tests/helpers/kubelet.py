"""A fake kubelet on loopback (GET /pods) and the pod list items it serves."""
from __future__ import annotations

import http.server
import json
import ssl
import threading
import time

TOKEN = "sa-token-abc.def.ghi"
CID = "3f4e" * 16


def pod_item(uid: str, name: str, namespace: str = "serving", containers=(("vllm", CID),)) -> dict:
    """One item of a kubelet /pods answer, in the shape the kubelet writes (v1 Pod)."""
    return {"metadata": {"name": name, "namespace": namespace, "uid": uid,
                         "labels": {"app": name.split("-")[0]}},
            "spec": {"nodeName": "gpu-node-1", "containers": [{"name": c, "image": "vllm/vllm-openai"}
                                                               for c, _ in containers]},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": c, "containerID": f"containerd://{cid}", "ready": True} for c, cid in containers]}}


def pod_list(*items) -> dict:
    return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list(items)}


UID_A = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"
UID_B = "0a0b0c0d-1111-2222-3333-444455556666"


class Kubelet:
    """A loopback server answering GET /pods with whatever the test sets; records requests."""

    def __init__(self, tls: tuple[str, str] | None = None):
        self.body: bytes = json.dumps(pod_list(pod_item(UID_A, "llama-0"))).encode()
        self.status = 200
        self.delay_per_chunk = 0.0
        self.clock = None  # a ServerClock: the delay per chunk passes on it instead of in real time
        self.redirect_body_mib = 0  # > 0: answer with a 302 that streams this many MiB
        self.sent: list[int] = []
        self.requests: list[dict] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                owner.requests.append({"path": self.path, "authorization": self.headers.get("Authorization")})
                if owner.redirect_body_mib:
                    return self.redirect_with_a_huge_body()
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                if owner.delay_per_chunk:
                    for i in range(0, len(owner.body), 16):
                        self.wfile.write(owner.body[i:i + 16])
                        self.wfile.flush()
                        if owner.clock is not None:
                            owner.clock.pass_time(owner.delay_per_chunk)
                        else:
                            time.sleep(owner.delay_per_chunk)
                else:
                    self.wfile.write(owner.body)

            def redirect_with_a_huge_body(self):
                self.send_response(302)
                self.send_header("Location", "/pods")
                self.send_header("Content-Length", str(owner.redirect_body_mib << 20))
                self.end_headers()
                sent = 0
                try:
                    for _ in range(owner.redirect_body_mib):
                        self.wfile.write(bytes(1 << 20))
                        sent += 1 << 20
                except OSError:
                    pass  # the client hung up without reading it
                owner.sent.append(sent)
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        scheme = "http"
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}/pods"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
