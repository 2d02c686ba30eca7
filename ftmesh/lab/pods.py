"""Kubernetes pods in the lab: a StatefulSet's or an Indexed Job's container command, as
written in its manifest, run the way a kubelet would run it, on namespaces of a
:class:`~ftmesh.lab.netns.VirtualLan`.

Theory of operation. ``PodLab(docs, image_dir=...)`` reads the workload (a StatefulSet, or
an Indexed Job) and its headless Service (the StatefulSet's ``serviceName``, the Job's pod
``subdomain``) from parsed manifest documents and gives pod ``i`` (named ``<set>-<i>``, for
a Job the hostname ``<job>-<index>``) lab host ``i``. ``start(i)`` runs the first container
of the pod template like this:

* **Network and DNS.** The pod is host ``i``'s network namespace (its own IP on the bridge,
  a default route). ``ip netns exec`` bind-mounts ``/etc/netns/<namespace>/hosts`` over
  ``/etc/hosts``; this module writes that file for every pod: the Service's name
  (``<svc>.<ns>.svc.cluster.local`` and its shorter forms) resolves to the IP of every pod
  started and not deleted (a headless Service with ``publishNotReadyAddresses``), and the
  pod's own name to its IP. The files are rewritten in place (same inode) when pods come and
  go, so running pods see the change, as with cluster DNS.
* **PID 1.** ``unshare --pid --fork --mount-proc --uts`` starts this module's pod init as PID
  1 of a new PID namespace; it prepares the pod and ``exec``s the container's command, which
  is then PID 1 itself: a signal it has no handler for is ignored, as in a container.
* **Files.** The init builds a private root: a tmpfs holding the host's top-level
  directories bind-mounted (recursively: ``/etc/hosts`` comes along), a fresh ``/proc`` and
  ``/run``, the image at the container's ``workingDir`` (``image_dir``, e.g. the
  repository, as the Dockerfile copies it) and the pod's volumes at their ``mountPath``: a
  Secret's keys as files (``secrets``), a ``volumeClaimTemplates`` claim as a directory of
  its own per pod that outlives the pod's restarts, a ``persistentVolumeClaim`` volume as
  one directory every pod shares (ReadWriteMany), an ``emptyDir`` fresh each start. Then it
  ``chroot``s there. A volume is never created on the host: its ``mountPath`` must lie on
  the private tmpfs (a new top-level directory, or under ``/run``), else :class:`LabError`.
* **Environment and command.** ``env`` entries with ``value`` or a ``fieldRef``
  (``status.podIP``, ``metadata.name``, ``metadata.namespace``, ...), a Job pod's
  ``JOB_COMPLETION_INDEX`` (the Job controller adds it), the image's ``PATH``
  (``image_path`` first), and ``$(VAR)`` references in ``command`` and ``args`` expanded as
  the kubelet does (``$$`` is a literal ``$``; unknown names stay as written).

``signal(i, sig)`` goes to the pod's PID 1; ``restart(i)`` runs the container again in the
same pod (same IP, same claims), as a StatefulSet does with a container that exited, and
as a Job does when it replaces the pod of a failed index (a new pod there, with the same
hostname; the lab keeps the IP); ``delete(i)`` removes the pod (its IP leaves the
Service). Output goes to one log file per container start (``Pod.log_path``). ``close()``
kills everything, deletes the namespaces and the ``/etc/netns`` entries. Root only, like the
rest of the lab.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .errors import LabError
from .netns import VirtualLan

CLUSTER_DOMAIN = "cluster.local"
NETNS_ETC = Path("/etc/netns")
PRIVATE_ROOTS = Path("/run/ftmesh-lab")
"""Host directory holding one empty mount point per pod for its private root (the root's
tmpfs is mounted in the pod's own mount namespace only)."""
_VAR_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD_REFS = ("status.podIP", "metadata.name", "metadata.namespace", "spec.nodeName")


def load_manifest(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The documents of a YAML manifest (needs PyYAML, a dev dependency)."""
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - dev installs have it
        raise LabError("reading manifests needs PyYAML (pip install pyyaml)") from e
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in ``command`` and ``args``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_RE.sub(one, text)


@dataclass
class Pod:
    ordinal: int
    name: str
    ip: str
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    log_path: Path = Path()
    """Output of the current (last) container start."""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(frozen=True)
class _Mount:
    path: str
    source: str
    read_only: bool


@dataclass
class _PodSpec:
    """What the pod init needs (travels as JSON on its command line)."""

    hostname: str
    root: str
    workdir: str
    image_dir: str
    mounts: list[_Mount] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)


class PodLab:
    """A StatefulSet's or an Indexed Job's pods in the lab; see the module docstring.
    ``docs``: the manifest's
    documents; ``image_dir``: what the container image holds at its ``workingDir``;
    ``image_path``: directories put first on the image's ``PATH`` (where its ``ftmesh``
    is); ``secrets``: ``{secret name: {key: bytes}}`` for Secret volumes; ``pods``: most
    pods at once (lab hosts), default the StatefulSet's replicas or the Job's parallelism."""

    def __init__(
        self,
        docs: Sequence[Mapping[str, Any]],
        *,
        image_dir: str | os.PathLike[str],
        image_path: Sequence[str] = (),
        secrets: Mapping[str, Mapping[str, bytes]] | None = None,
        pods: int | None = None,
        namespace: str = "default",
        subnet: str = "10.79.0.0/24",
    ) -> None:
        kinds = [d for d in docs if d.get("kind") in ("StatefulSet", "Job")]
        if len(kinds) != 1:
            raise LabError(f"the manifest has {len(kinds)} StatefulSets and Jobs, not one")
        self.workload = _one(docs, kinds[0]["kind"])
        self.is_job = self.workload["kind"] == "Job"
        spec = self.workload["spec"]
        if self.is_job:
            if spec.get("completionMode") != "Indexed":
                raise LabError("the Job is not Indexed (completionMode: Indexed)")
            svc_name = spec["template"]["spec"].get("subdomain")
            self.replicas = int(spec.get("parallelism", 1))
        else:
            svc_name = spec["serviceName"]
            self.replicas = int(spec.get("replicas", 1))
        if not svc_name:
            raise LabError("the pods have no Service (serviceName, or a Job's subdomain)")
        self.service = _one(docs, "Service", svc_name)
        if self.service["spec"].get("clusterIP") != "None":
            raise LabError(f"Service {svc_name} is not headless (clusterIP: None)")
        self.name = str(self.workload["metadata"]["name"])
        self.namespace = namespace
        self.template = spec["template"]["spec"]
        self.container = self.template["containers"][0]
        self.image_dir = Path(image_dir).resolve()
        self.image_path = list(image_path)
        self.secrets = {k: dict(v) for k, v in (secrets or {}).items()}
        self.grace_s = float(self.template.get("terminationGracePeriodSeconds", 30))
        count = self.replicas if pods is None else pods
        self._netns_dirs: list[Path] = []
        self._roots: list[Path] = []
        self.pods: list[Pod] = []
        self.lan = VirtualLan(hosts=count, prefix="ftmpod", subnet=subnet)
        self._tmp = Path(tempfile.mkdtemp(prefix="ftmesh-pods-"))
        try:
            self.pods = [Pod(i, f"{self.name}-{i}", self.lan.host_ip(i)) for i in range(count)]
            self._in_dns: set[int] = set()
            for pod in self.pods:
                d = NETNS_ETC / self.lan.ns_name(pod.ordinal)
                d.mkdir(parents=True, exist_ok=True)
                self._netns_dirs.append(d)
                (d / "hosts").write_text("")
        except BaseException:
            self.close()
            raise

    # -- names -----------------------------------------------------------------------------
    @property
    def service_fqdn(self) -> str:
        svc = self.service["metadata"]["name"]
        return f"{svc}.{self.namespace}.svc.{CLUSTER_DOMAIN}"

    def _hosts_text(self, pod: Pod) -> str:
        svc = self.service["metadata"]["name"]
        fqdn = self.service_fqdn
        names = f"{fqdn} {svc}.{self.namespace}.svc {svc}.{self.namespace} {svc}"
        lines = ["127.0.0.1\tlocalhost", f"{pod.ip}\t{pod.name}.{fqdn} {pod.name}"]
        lines += [f"{self.pods[i].ip}\t{names}" for i in sorted(self._in_dns)]
        return "\n".join(lines) + "\n"

    def _write_dns(self) -> None:
        for pod in self.pods:
            with open(self._netns_dirs[pod.ordinal] / "hosts", "r+") as f:  # same inode
                f.truncate(0)
                f.write(self._hosts_text(pod))

    # -- pods ------------------------------------------------------------------------------
    def start(self, i: int) -> Pod:
        """Create pod ``i`` (or run its container again) and start its command."""
        pod = self.pods[i]
        if pod.running:
            raise LabError(f"pod {pod.name} is running")
        self._in_dns.add(i)
        self._write_dns()
        spec = self._pod_spec(pod)
        pod.starts += 1
        pod.log_path = self._tmp / f"{pod.name}.{pod.starts}.log"
        init = [sys.executable, "-m", "ftmesh.lab.pods", "--init", json.dumps(_to_json(spec))]
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "--", *init]
        with open(pod.log_path, "wb") as log:
            pod.proc = self.lan.popen(
                i, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        return pod

    def restart(self, i: int) -> Pod:
        """The container of pod ``i`` exited; run it again in the same pod."""
        pod = self.pods[i]
        if pod.proc is not None and pod.running:
            raise LabError(f"pod {pod.name} is still running")
        return self.start(i)

    def delete(self, i: int, timeout: float | None = None) -> int | None:
        """Delete pod ``i``: SIGTERM, SIGKILL after the grace period, out of the Service."""
        pod = self.pods[i]
        rc = None
        if pod.running:
            self.signal(i, signal.SIGTERM)
            rc = self.wait(i, self.grace_s if timeout is None else timeout, kill=True)
        self._in_dns.discard(i)
        self._write_dns()
        return rc

    def pid1(self, i: int, timeout: float = 10.0) -> int:
        """Host pid of pod ``i``'s PID 1 (``unshare``'s child)."""
        pod = self.pods[i]
        assert pod.proc is not None
        deadline = time.monotonic() + timeout
        path = Path(f"/proc/{pod.proc.pid}/task/{pod.proc.pid}/children")
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                kids = path.read_text().split()
                if kids:
                    return int(kids[0])
            if not pod.running:
                break
            time.sleep(0.01)
        raise LabError(f"pod {pod.name} has no PID 1")

    def signal(self, i: int, sig: int) -> None:
        """Send ``sig`` to pod ``i``'s PID 1 (from outside its PID namespace, like the
        kubelet: PID 1 only gets signals it handles)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid1(i), sig)

    def wait(self, i: int, timeout: float, *, kill: bool = False) -> int | None:
        """Exit status of pod ``i``'s container within ``timeout`` seconds (None: still
        running; with ``kill``, SIGKILLed then, as after a grace period)."""
        pod = self.pods[i]
        assert pod.proc is not None
        try:
            return pod.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if not kill:
                return None
        with contextlib.suppress(LabError, ProcessLookupError):
            os.kill(self.pid1(i, timeout=1.0), signal.SIGKILL)
        pod.proc.kill()
        return pod.proc.wait(10)

    def logs(self, i: int) -> str:
        return self.pods[i].log_path.read_text(errors="replace")

    # -- the pod's files -------------------------------------------------------------------
    def _pod_spec(self, pod: Pod) -> _PodSpec:
        c = self.container
        root = PRIVATE_ROOTS / f"{self.lan.prefix}-{pod.name}"
        root.mkdir(parents=True, exist_ok=True)
        if root not in self._roots:
            self._roots.append(root)
        env = {
            "PATH": os.pathsep.join([*self.image_path, "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": "/root",
            "HOSTNAME": pod.name,
        }
        if self.is_job:  # the Job controller adds it to every container of an Indexed Job
            env["JOB_COMPLETION_INDEX"] = str(pod.ordinal)
        for item in c.get("env", []):
            env[item["name"]] = self._env_value(pod, item, env)
        argv = [expand_vars(str(a), env) for a in [*c.get("command", []), *c.get("args", [])]]
        if not argv:
            raise LabError("the container has no command (the image's entrypoint is unknown)")
        return _PodSpec(
            hostname=pod.name,
            root=str(root),
            workdir=str(c.get("workingDir", "/")),
            image_dir=str(self.image_dir),
            mounts=[self._mount(pod, m) for m in c.get("volumeMounts", [])],
            env=env,
            argv=argv,
        )

    def _env_value(self, pod: Pod, item: Mapping[str, Any], env: Mapping[str, str]) -> str:
        if "value" in item:
            return expand_vars(str(item["value"]), env)
        ref = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        values = {
            "status.podIP": pod.ip,
            "metadata.name": pod.name,
            "metadata.namespace": self.namespace,
            "spec.nodeName": "lab",
        }
        if ref not in values:
            raise LabError(f"env {item.get('name')}: only value and fieldRef {_FIELD_REFS}")
        return values[ref]

    def _mount(self, pod: Pod, m: Mapping[str, Any]) -> _Mount:
        name = m["name"]
        volumes = {v["name"]: v for v in self.template.get("volumes", [])}
        claims = {
            t["metadata"]["name"] for t in self.workload["spec"].get("volumeClaimTemplates", [])
        }
        read_only = bool(m.get("readOnly", False))
        if name in claims:  # one per pod, kept across restarts (a PersistentVolumeClaim)
            src = self._tmp / "claims" / f"{name}-{pod.name}"
        elif name in volumes and "persistentVolumeClaim" in volumes[name]:
            pvc = volumes[name]["persistentVolumeClaim"]
            src = self.shared_claim_dir(str(pvc["claimName"]))  # every pod's (ReadWriteMany)
            read_only = read_only or bool(pvc.get("readOnly", False))
        elif name in volumes and "secret" in volumes[name]:
            secret = volumes[name]["secret"]["secretName"]
            if secret not in self.secrets:
                raise LabError(f"volume {name}: no secret {secret!r} given to the lab")
            src = self._tmp / "secrets" / f"{pod.name}-{name}-{pod.starts}"
            src.mkdir(parents=True, exist_ok=True)
            for key, data in self.secrets[secret].items():
                (src / key).write_bytes(data)
            read_only = True
        elif name in volumes and "emptyDir" in volumes[name]:
            src = self._tmp / "empty" / f"{pod.name}-{name}-{pod.starts}"
        else:
            raise LabError(f"volume {name}: not a claim, PVC, Secret or emptyDir of the pod")
        src.mkdir(parents=True, exist_ok=True)
        return _Mount(str(m["mountPath"]), str(src), read_only)

    def claim_dir(self, i: int, claim: str) -> Path:
        """The host directory behind pod ``i``'s claim ``claim``."""
        return self._tmp / "claims" / f"{claim}-{self.pods[i].name}"

    def shared_claim_dir(self, claim_name: str) -> Path:
        """The host directory behind the PersistentVolumeClaim ``claim_name`` that pods
        mount through a ``persistentVolumeClaim`` volume (one for all of them)."""
        return self._tmp / "shared-claims" / claim_name

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every pod, delete the lab and its files. Idempotent."""
        for pod in self.pods:
            if pod.proc is not None and pod.proc.poll() is None:
                with contextlib.suppress(LabError, ProcessLookupError):
                    os.kill(self.pid1(pod.ordinal, timeout=0.5), signal.SIGKILL)
                pod.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pod.proc.wait(10)
        self.lan.down()
        for d in self._netns_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._netns_dirs.clear()
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only if empty: others may use it
        for root in self._roots:
            with contextlib.suppress(OSError):
                root.rmdir()
        with contextlib.suppress(OSError):
            PRIVATE_ROOTS.rmdir()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _one(docs: Sequence[Mapping[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        dict(d)
        for d in docs
        if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
    ]
    if len(found) != 1:
        raise LabError(f"the manifest has {len(found)} {kind}s{f' named {name}' if name else ''}")
    return found[0]


def _to_json(spec: _PodSpec) -> dict[str, Any]:
    return {
        **{k: v for k, v in vars(spec).items() if k != "mounts"},
        "mounts": [vars(m) for m in spec.mounts],
    }


# -- the pod init: PID 1 of the pod until it execs the container's command ------------------
def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _make_dirs(root: Path, path: str, owned: set[Path]) -> Path:
    """Create ``path`` inside ``root`` (following symlinks within ``root``), only on the
    private tmpfs: ``owned`` holds the directories that are (``root`` and ``/run``)."""
    cur = root
    for part in Path(path).parts[1:]:
        nxt = cur / part
        if nxt.is_symlink():
            target = os.readlink(nxt)
            nxt = root / target.lstrip("/") if target.startswith("/") else cur / target
            nxt = Path(os.path.normpath(nxt))
        if not nxt.exists():
            if cur not in owned:
                raise LabError(f"mountPath {path} would create {nxt} on the host")
            nxt.mkdir()
            owned.add(nxt)
        cur = nxt
    return cur


def _pod_init(spec: dict[str, Any]) -> None:
    root = Path(spec["root"])
    socket.sethostname(spec["hostname"])
    _mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(root))
    for entry in sorted(os.listdir("/")):
        host, mine = Path("/") / entry, root / entry
        if host.is_symlink():
            os.symlink(os.readlink(host), mine)
        elif host.is_dir():
            mine.mkdir()
            if entry == "proc":
                _mount("-t", "proc", "proc", str(mine))
            elif entry == "run":
                _mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(mine))
            else:
                _mount("--rbind", str(host), str(mine))
    owned = {root, root / "run"}
    targets = [(spec["workdir"], spec["image_dir"], False)]
    targets += [(m["path"], m["source"], m["read_only"]) for m in spec["mounts"]]
    for path, source, read_only in targets:
        where = _make_dirs(root, path, owned)
        _mount("--bind", source, str(where))
        if read_only:
            _mount("-o", "remount,bind,ro", str(where))
    os.chroot(root)
    os.chdir(spec["workdir"])
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    if sys.argv[1:2] != ["--init"] or len(sys.argv) != 3:
        sys.exit("usage: python -m ftmesh.lab.pods --init SPEC_JSON (used by PodLab)")
    try:
        _pod_init(json.loads(sys.argv[2]))
    except (OSError, LabError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        sys.exit(f"pod init: {exc} {detail.decode(errors='replace').strip()}")
