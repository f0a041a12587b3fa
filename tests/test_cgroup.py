import pytest

from exporter.sources.cgroup import parse_cgroup

CID = "3f4e" * 16
UID = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"


@pytest.mark.parametrize("text, expected", [
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
     f"cri-containerd-{CID}.scope\n", (CID, UID)),
    (f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n", (CID, UID)),
    (f"12:pids:/kubepods/burstable/pod{UID}/{CID}\n11:memory:/kubepods/burstable/pod{UID}/{CID}\n", (CID, UID)),
    (f"0::/system.slice/docker-{CID}.scope\n", (CID, "")),
    (f"4:devices:/docker/{CID}\n", (CID, "")),
    (f"0::/machine.slice/libpod-{CID}.scope/container\n", (CID, "")),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", ("", "")),
    ("", ("", "")),
    ("garbage without colons", ("", "")),
])
def test_container_and_pod(text, expected):
    assert parse_cgroup(text) == expected
