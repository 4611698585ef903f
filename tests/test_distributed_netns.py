"""Two machines for real, on one box: tensor parallel across a network boundary.

The test builds a network namespace joined to this one by a veth pair (addresses only on that
pair: 10.77.N.1 here, 10.77.N.2 there; the interface has the same name on both sides, as a
NIC would on two identical hosts), runs an sshd on each end with a key made for the test, and
starts a 2-rank cluster with ipyparallel's SSH launcher: the controller on this side's address,
one engine through each sshd, so rank 1 lives in the other namespace and reaches rank 0 only
over the veth. gloo and oneCCL rendezvous over that interface (`iface=`); the greedy tokens
must be one process's. Everything the test creates (namespace, veth, sshd processes, keys) is
deleted at the end. Skipped with the reason where namespaces or sshd are not available
(.ci/run installs openssh-server).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ipyparallel")

import workbench as wb  # noqa: E402
from workbench.distributed.cluster import Cluster  # noqa: E402

SSHD = "/usr/sbin/sshd"
PROMPT = "The capital of France is"
PORT = 2222


def _need(cond: bool, why: str) -> None:
    if not cond:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide this: {why}")
        pytest.skip(why)


def _run(*cmd: str, ns: str | None = None) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    r = subprocess.run(full, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed: {r.stderr.strip()}")
    return r


def _wait_for_port(host: str, port: int, ns: str | None, timeout_s: float = 20.0) -> None:
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    deadline = time.monotonic() + timeout_s  # a hang guard, not a timing assertion
    while time.monotonic() < deadline:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + [sys.executable, "-c", probe]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"sshd did not listen on {host}:{port}")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """(this side's address, the other side's, the interface name, launcher_config)."""
    _need(os.geteuid() == 0, "network namespaces need root")
    _need(shutil.which("ip") is not None, "iproute2's `ip` is not installed")
    _need(Path(SSHD).exists() and shutil.which("ssh") is not None,
          "openssh-server is not installed (apt-get install openssh-server)")
    tag = os.getpid() % 250 + 1
    ns, here_if, there_if, iface = f"wbnet{tag}", f"wbh{tag}", f"wbt{tag}", f"wbv{tag}"
    here, there = f"10.77.{tag}.1", f"10.77.{tag}.2"
    try:
        _run("ip", "netns", "add", ns)
    except RuntimeError as e:
        _need(False, f"cannot create a network namespace here: {e}")
    tmp = tmp_path_factory.mktemp("netns")
    sshds: list[subprocess.Popen] = []
    try:
        _run("ip", "link", "add", here_if, "type", "veth", "peer", "name", there_if)
        _run("ip", "link", "set", there_if, "netns", ns)
        # one name on both ends, as on two identical hosts: iface= names it for every rank
        _run("ip", "link", "set", here_if, "name", iface)
        _run("ip", "link", "set", there_if, "name", iface, ns=ns)
        _run("ip", "addr", "add", f"{here}/30", "dev", iface)
        _run("ip", "link", "set", iface, "up")
        _run("ip", "addr", "add", f"{there}/30", "dev", iface, ns=ns)
        _run("ip", "link", "set", iface, "up", ns=ns)
        _run("ip", "link", "set", "lo", "up", ns=ns)

        key, host_key = tmp / "id_test", tmp / "host_key"
        for k in (key, host_key):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k))
        (tmp / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        for side, addr in (("here", here), ("there", there)):
            config = tmp / f"sshd-{side}.conf"
            config.write_text(f"ListenAddress {addr}\nPort {PORT}\nHostKey {host_key}\nPidFile {tmp}/sshd-{side}.pid\n"
                              f"AuthorizedKeysFile {tmp}/authorized_keys\nPermitRootLogin prohibit-password\n"
                              "PasswordAuthentication no\nStrictModes no\nUsePAM no\n"
                              "Subsystem sftp /usr/lib/openssh/sftp-server\n")  # scp speaks SFTP
            cmd = [SSHD, "-D", "-e", "-f", str(config)]
            sshds.append(subprocess.Popen((["ip", "netns", "exec", ns] if side == "there" else []) + cmd,
                                          stdout=subprocess.DEVNULL, stderr=open(tmp / f"sshd-{side}.log", "w")))
            _wait_for_port(addr, PORT, ns if side == "there" else None)
        # One connection per host, reused by every later ssh and scp (ControlMaster): the
        # launcher runs about a dozen remote commands per start and stop, each otherwise a
        # new connection of its own.
        ssh_opts = ["-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                    "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "ControlMaster=auto",
                    "-o", f"ControlPath={tmp}/ssh-%C", "-o", "ControlPersist=60"]
        config = {"SSHEngineSetLauncher": {"engines": {f"root@{here}:{PORT}": 1, f"root@{there}:{PORT}": 1},
                                           "ssh_args": ssh_opts, "scp_args": ssh_opts}}
        yield here, there, iface, config
    finally:
        for p in sshds:
            p.kill()
            p.wait()
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "delete", iface], capture_output=True)  # if the move never happened


@pytest.fixture(scope="module")
def reference_tokens():
    return wb.load_model("smollm2-135m").generate(PROMPT, max_new_tokens=12, stop_at_eos=False).token_ids


@pytest.mark.parametrize("backend", ["gloo", "ccl"])
def test_a_rank_across_the_veth_gives_one_process_tokens(two_hosts, reference_tokens, backend):
    from workbench.distributed import ccl

    if backend == "ccl" and not ccl.available():
        _need(False, ccl.INSTALL_HINT)
    here, there, iface, config = two_hosts
    cluster = Cluster(2, backend=backend, launcher="ssh", ip=here, iface=iface, timeout_s=30,
                      launcher_config=config).start()
    try:
        # one engine in each namespace: the other side's sees only its own veth address
        listed = cluster.run(subprocess.check_output, ["ip", "-4", "-o", "addr", "show"], what="listing addresses")[0]
        where = [_addresses(out.decode()) for out in listed]
        assert sorted(a for addrs in where for a in addrs if a.startswith("10.77.")) == sorted([here, there])
        assert any(addrs == [there] for addrs in where), where
        model = cluster.load_model("smollm2-135m")
        out = model.generate(PROMPT, max_new_tokens=12, stop_at_eos=False)
        assert out.token_ids == reference_tokens
        assert cluster.status()["launcher"] == "ssh"
        assert cluster.environment().get("GLOO_SOCKET_IFNAME", iface) == iface or backend == "ccl"
    finally:
        cluster.stop()


def _addresses(ip_addr_show: str) -> list[str]:
    """The IPv4 addresses in `ip -4 -o addr show`'s output, loopback left out."""
    return [line.split()[3].split("/")[0] for line in ip_addr_show.splitlines() if " lo " not in line]
