"""Container id and Kubernetes pod UID from the text of /proc/<pid>/cgroup (v1 and v2).

Shapes seen in the field, all handled:
  v2 systemd + containerd  0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>
                           .slice/cri-containerd-<id>.scope   (one line, wrapped here)
  v2 systemd + CRI-O       0::/kubepods.slice/kubepods-pod<uid>.slice/crio-<id>.scope
  v1 cgroupfs              11:memory:/kubepods/burstable/pod<uid>/<id>
  Docker                   0::/system.slice/docker-<id>.scope   or   12:pids:/docker/<id>
  Podman                   0::/machine.slice/libpod-<id>.scope
"""
from __future__ import annotations

import functools
import re

_CONTAINER = re.compile(r"(?:^|[/-])(?:cri-containerd-|crio-|docker-|libpod-|containerd-)?([0-9a-f]{64})(?:\.scope)?$")
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@functools.lru_cache(maxsize=4096)  # a process's cgroup text is read every tick, and rarely new
def parse_cgroup(text: str) -> tuple[str, str]:
    """Return (container_id, pod_uid); empty strings where the process is in neither."""
    container = pod = ""
    for line in text.splitlines():
        path = line.split(":", 2)[-1].strip()
        if not path:
            continue
        for part in reversed(path.split("/")):
            m = _CONTAINER.search(part)
            if m and not container:
                container = m.group(1)
                break
        m = _POD.search(path)
        if m and not pod:
            pod = m.group(1).replace("_", "-")
        if container and pod:
            break
    return container, pod
