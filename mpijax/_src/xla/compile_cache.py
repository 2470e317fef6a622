"""The compile cache's entries and claims: one rank compiles, the others load.

The cache lives in ``<jax_compilation_cache_dir>/mpijax/``. Each program has
two names there, both from its key (``compile_hook.program_key``):

* ``<key>.xla``, the entry: a header (format, key, jaxlib version, length and
  SHA-256 of the payload, which rank compiled it and how long that took) and
  the serialized executable, zlib-compressed. It is written under a
  temporary name and renamed into place, so a reader sees a whole entry or
  none, also with several jobs writing one directory and on a shared
  filesystem (rename is atomic on NFS, Lustre and GPFS too). A torn,
  corrupt or foreign entry fails :func:`read_entry` and is recompiled.
* ``<key>.claim``, while a rank compiles the program: created exclusively
  (``O_CREAT | O_EXCL``), holding its owner (rank, host, process, job), its
  time refreshed every :data:`HEARTBEAT_S` by a thread of the owner's. The
  ranks that miss the entry while a claim stands wait for the entry instead
  of compiling the same program at the same time (:func:`fetch`). A claim
  whose owner is gone (its process no longer runs, on this host; or its time
  has not moved for ``stale_s``) is broken and the waiter compiles itself,
  so a dead rank costs its peers a delay, never a hang.

Ranks that see the same directory share its compiles: one per job on a
shared filesystem, one per node on node-local disk.

Nothing here imports JAX: the caller hands :func:`fetch` its compile,
serialize and load functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

FORMAT = 1
MAGIC = b"MPIJAXC\x01"
ENTRY, CLAIM = ".xla", ".claim"
HEARTBEAT_S = 1.0
# A claim whose time stands still this long is abandoned (its owner was
# stopped or its host lost); a live owner refreshes it every HEARTBEAT_S.
STALE_S = 30.0
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.05  # a waiter's look at the entry, backing off


class EntryError(Exception):
  """Why an entry cannot be used (truncated, corrupt, of another jaxlib or key)."""


class Unwritable(OSError):
  """The cache directory cannot be written: entries are read, none are written."""


@dataclasses.dataclass(frozen=True)
class Owner:
  """Who holds a claim (or wrote an entry)."""

  rank: int
  host: str
  pid: int
  job: str  # the job's coordinator address: unique among the jobs running at once
  pidns: str = ""  # /proc/self/ns/pid: a pid means this process only inside it
  started: int = 0  # the process's start time in clock ticks (/proc/<pid>/stat)

  def describe(self, job: str) -> str:
    """``rank 2`` in the caller's own job, else where the other job's process is."""
    if self.job == job:
      return f"rank {self.rank}"
    return f"rank {self.rank} of another job (host {self.host}, pid {self.pid})"


def _pid_namespace() -> str:
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return ""


def _start_ticks(pid: int) -> int:
  """The start time of process ``pid`` (clock ticks since boot); 0 if it is
  not running (no such process, or a zombie: it has exited)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    return 0 if fields[0] in ("Z", "X") else int(fields[19])
  except (OSError, IndexError, ValueError):
    return 0


def me(rank: int, job: str) -> Owner:
  """This process as a claim's owner."""
  pid = os.getpid()
  return Owner(rank, socket.gethostname(), pid, job, _pid_namespace(), _start_ticks(pid))


def owner_gone(owner: Owner) -> bool:
  """Whether ``owner``'s process provably no longer runs (only decidable on
  this host, in this PID namespace; elsewhere the claim's time decides)."""
  if owner.host != socket.gethostname() or not owner.pidns or owner.pidns != _pid_namespace():
    return False
  started = _start_ticks(owner.pid)
  return started == 0 or (owner.started != 0 and started != owner.started)


# --- where ----------------------------------------------------------------------------

JAX_ENV = "JAX_COMPILATION_CACHE_DIR"


def job_directory(setting: str, env: dict[str, str]) -> str | None:
  """The cache directory mpijax-run gives a job, from setting ``compile_cache``:
  None where the user named JAX's own (``JAX_COMPILATION_CACHE_DIR``) or the
  setting is ``off``."""
  if env.get(JAX_ENV) or setting == "off":
    return None
  if setting != "auto":
    return os.path.abspath(os.path.expanduser(setting))
  home = env.get("HOME") or os.path.expanduser("~")
  base = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
  return os.path.join(base, "mpijax", "jax")


# --- entries --------------------------------------------------------------------------


def entry_path(directory: str, key: str) -> str:
  return os.path.join(directory, key + ENTRY)


def pack(key: str, jaxlib: str, payload: bytes, **meta: Any) -> list[bytes]:
  """An entry's bytes: magic, header length, header (JSON), compressed payload."""
  body = zlib.compress(payload, 1)
  header = dict(
    format=FORMAT,
    key=key,
    jaxlib=jaxlib,
    length=len(body),
    sha256=hashlib.sha256(body).hexdigest(),
    **meta,
  )
  text = json.dumps(header, sort_keys=True).encode()
  return [MAGIC, struct.pack("<I", len(text)), text, body]


def unpack(data: bytes, key: str, jaxlib: str) -> tuple[bytes, dict[str, Any]]:
  """The payload and header of an entry's bytes, or EntryError saying what is wrong."""
  if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
    raise EntryError("not an mpijax compile cache entry, or truncated to its first bytes")
  (n,) = struct.unpack_from("<I", data, len(MAGIC))
  start = len(MAGIC) + 4
  try:
    header = json.loads(data[start : start + n])
  except ValueError:
    raise EntryError("its header is corrupt or truncated") from None
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise EntryError(f"its format is {header.get('format')!r}, not {FORMAT}")
  if header.get("jaxlib") != jaxlib:
    raise EntryError(f"it was written by jaxlib {header.get('jaxlib')}, this is jaxlib {jaxlib}")
  if header.get("key") != key:
    raise EntryError("it holds another program (its key differs)")
  body = data[start + n :]
  if len(body) != header.get("length"):
    raise EntryError(f"it is truncated ({len(body)} of {header.get('length')} bytes)")
  if hashlib.sha256(body).hexdigest() != header.get("sha256"):
    raise EntryError("its checksum does not match (corrupt)")
  try:
    return zlib.decompress(body), header
  except zlib.error as e:
    raise EntryError(f"it does not decompress ({e})") from None


def read_entry(path: str, key: str, jaxlib: str) -> tuple[bytes, dict[str, Any]] | None:
  """The payload and header at ``path``; None if there is no entry; EntryError if bad."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    return None
  except OSError as e:
    raise EntryError(f"it cannot be read ({e.strerror})") from None
  return unpack(data, key, jaxlib)


def write_entry(path: str, parts: list[bytes]) -> None:
  """Writes an entry atomically: a temporary file in the same directory, renamed.

  Not fsynced: a compile costs more than the sync, but an entry torn by a
  power cut only fails its checksum and is compiled again.
  """
  directory = os.path.dirname(path)
  try:
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=directory)
  except OSError as e:
    raise _unwritable(e, directory) from None
  try:
    with os.fdopen(fd, "wb") as f:
      for part in parts:
        f.write(part)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    if isinstance(e, OSError):
      raise _unwritable(e, directory) from None
    raise


def discard(path: str) -> None:
  """Removes a bad entry (a rename first, so a concurrent reader sees it whole or not at all)."""
  aside = f"{path}.bad-{os.getpid()}-{threading.get_ident()}"
  with contextlib.suppress(OSError):
    os.rename(path, aside)
    os.unlink(aside)


def _unwritable(e: OSError, directory: str) -> Unwritable:
  return Unwritable(e.errno, e.strerror, directory)


# --- claims ---------------------------------------------------------------------------


class Claim:
  """A held claim: its file's time is refreshed until :meth:`release`."""

  def __init__(self, path: str, text: bytes) -> None:
    self.path, self.text = path, text
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="mpijax-compile-claim", daemon=True)
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      with contextlib.suppress(OSError):
        os.utime(self.path)

  def release(self) -> None:
    """Stops the heartbeat and removes the claim if it is still this one."""
    self._stop.set()
    self._thread.join()
    with contextlib.suppress(OSError):
      with open(self.path, "rb") as f:
        if f.read() != self.text:
          return  # broken by a waiter that thought this process gone: theirs now
      os.unlink(self.path)


def try_claim(path: str, owner: Owner) -> Claim | None:
  """Claims ``path`` for ``owner``; None if someone else holds it; Unwritable if
  the directory cannot be written."""
  text = json.dumps(dataclasses.asdict(owner), sort_keys=True).encode()
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return None
  except FileNotFoundError:
    raise  # no directory yet: the caller makes it
  except OSError as e:
    raise _unwritable(e, os.path.dirname(path)) from None
  try:
    os.write(fd, text)
  finally:
    os.close(fd)
  return Claim(path, text)


def read_claim(path: str) -> tuple[Owner | None, int] | None:
  """(owner, its time in ns) of the claim at ``path``, or None if there is none.

  The owner is None while its creator has not written it yet (or it is not
  readable as one).
  """
  try:
    with open(path, "rb") as f:
      stat = os.fstat(f.fileno())
      text = f.read()
  except FileNotFoundError:
    return None
  except OSError:
    return None, 0
  try:
    owner = Owner(**json.loads(text))
  except (ValueError, TypeError):
    owner = None
  return owner, stat.st_mtime_ns


def break_claim(path: str) -> None:
  """Removes an abandoned claim: renamed aside first, so of several waiters that
  found it abandoned only one removes it."""
  aside = f"{path}.broken-{os.getpid()}-{threading.get_ident()}"
  with contextlib.suppress(OSError):
    os.rename(path, aside)
    os.unlink(aside)


# --- one program ----------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
  """How :func:`fetch` got the executable."""

  how: str  # "loaded" (an entry was there), "compiled", "waited" (for another's compile)
  owner: Owner | None = None  # whose compile was waited for
  warning: str = ""  # an unusable entry, recompiled: one line for the user ('' if none)
  waited_s: float = 0.0
  unwritable: str = ""  # why the directory cannot be written ('' if it can)


def fetch(
  directory: str,
  key: str,
  *,
  jaxlib: str,
  owner: Owner,
  compile: Callable[[], Any],
  serialize: Callable[[Any], bytes],
  load: Callable[[bytes], Any],
  waiting: Callable[[Owner | None], contextlib.AbstractContextManager],
  stale_s: float = STALE_S,
  meta: dict[str, Any] | None = None,
) -> tuple[Any, Outcome]:
  """The executable of ``key``: loaded from its entry, compiled here (and
  written), or loaded after waiting for the rank that compiles it.

  Args:
    directory: the cache's directory (``<cache dir>/mpijax``), created if needed.
    key: the program's key.
    jaxlib: the running jaxlib's version (an entry of another is recompiled).
    owner: this process, as a claim's owner.
    compile: compiles the program; its exceptions pass through (after the
      claim is released, so the waiters compile and raise the same).
    serialize: the bytes of a compiled executable.
    load: the executable from those bytes; an exception there makes the
      entry bad (recompiled, with a warning).
    waiting: a context manager entered while waiting for another owner's
      compile (for stall reports and the timeline).
    stale_s: how long a claim's time may stand still before it is broken.
    meta: more header fields of a written entry.

  Returns:
    The executable and how it was had. An unwritable directory is no error:
    the program is compiled here, and the outcome says why it was not written.
  """
  path = entry_path(directory, key)
  claim_path = os.path.join(directory, key + CLAIM)
  warning = ""
  wait_start = None
  seen: tuple[int, float] = (0, 0.0)  # (claim time, when it last moved, monotonic)
  delay = _POLL_MIN_S
  holder: Owner | None = None
  wait_ctx: contextlib.ExitStack | None = None
  try:
    while True:
      try:
        got = read_entry(path, key, jaxlib)
        if got is not None:
          try:
            exe = load(got[0])
          except Exception as e:  # noqa: BLE001 -- a bad entry is recompiled
            raise EntryError(f"it does not load ({type(e).__name__}: {e})") from None
          waited = time.monotonic() - wait_start if wait_start is not None else 0.0
          how = "waited" if wait_start is not None else "loaded"
          return exe, Outcome(how, holder, warning, waited)
      except EntryError as e:
        discard(path)
        warning = f"the compile cache entry {path} is unusable: {e}; compiling the program again"
      try:
        claim = try_claim(claim_path, owner)
      except FileNotFoundError:
        try:
          os.makedirs(directory, exist_ok=True)
        except OSError as e:
          return compile(), Outcome("compiled", None, warning, unwritable=_why(e, directory))
        continue
      except Unwritable as e:
        return compile(), Outcome("compiled", None, warning, unwritable=_why(e, directory))
      if claim is not None:
        if wait_ctx is not None:
          wait_ctx.close()
          wait_ctx = None
        return _compile_and_write(
          path, key, jaxlib, claim, owner, compile, serialize, warning, meta or {}
        )
      state = read_claim(claim_path)
      if state is None:
        continue  # released just now: the entry is there, or it failed to compile
      who, stamp = state
      now = time.monotonic()
      if wait_start is None:
        wait_start = now
      if who is not None and who != holder:
        holder = who
        if wait_ctx is not None:
          wait_ctx.close()
        wait_ctx = contextlib.ExitStack()
        wait_ctx.enter_context(waiting(holder))
      if stamp != seen[0] or not seen[1]:
        seen = (stamp, now)  # moved (or first seen): it stands still from now on, if at all
      if (who is not None and owner_gone(who)) or now - seen[1] > stale_s:
        break_claim(claim_path)
        seen = (0, now)
        continue
      time.sleep(delay)
      delay = min(delay * 2, _POLL_MAX_S)
  finally:
    if wait_ctx is not None:
      wait_ctx.close()


def _compile_and_write(
  path: str,
  key: str,
  jaxlib: str,
  claim: Claim,
  owner: Owner,
  compile: Callable[[], Any],
  serialize: Callable[[Any], bytes],
  warning: str,
  meta: dict[str, Any],
) -> tuple[Any, Outcome]:
  try:
    start = time.monotonic()
    exe = compile()
    seconds = time.monotonic() - start
    try:
      parts = pack(
        key,
        jaxlib,
        serialize(exe),
        rank=owner.rank,
        host=owner.host,
        compile_s=round(seconds, 3),
        **meta,
      )
      write_entry(path, parts)
    except Unwritable as e:
      return exe, Outcome("compiled", None, warning, unwritable=_why(e, os.path.dirname(path)))
    return exe, Outcome("compiled", None, warning)
  finally:
    claim.release()


def _why(e: OSError, directory: str) -> str:
  return e.strerror or str(e)


@contextlib.contextmanager
def nothing(_owner: Owner | None) -> Iterator[None]:
  yield
