"""``offloadd serve``: the asyncio service around one I/O engine shared by all sessions.

The :class:`Server` listens, accepts and reads its connections, and shuts down; what it reads
goes to :class:`~offloadd.daemon.handlers.Handlers`, which queue I/O with the
:class:`~offloadd.daemon.scheduler.Scheduler`; :class:`~offloadd.daemon.status.Status` keeps
the figures that ``offloadd status`` shows.

Note: [never blocked by a client] The loop only does non-blocking socket calls (it reads with
``recvmsg`` when a socket is readable and writes what the socket takes, keeping the rest in a
bounded buffer), and the engine's threads never wait on a client. A client that stops reading
gets its replies buffered up to a limit and is then dropped; a client that dies is seen as end
of file. Neither delays any other session.

Note: [socket modes] The socket is 0600 without ``allowed_uids``: no other user reaches it.
With ``allowed_uids`` it is 0666: any local user may connect, and the SO_PEERCRED check at
accept (the daemon's own uid, or one of ``allowed_uids``) keeps the others out before a byte of
theirs is read; they are logged and counted (``refused_connections``). The socket's directory
must pass the rule of offloadd/wire/trust.py [who trusts whom] (the daemon's own, not a
symbolic link, not writable by group or others). Its mode is set only when the daemon created it
(at this start, or ``offloadd serve --socket`` just before it): 0700, or 0711 with
``allowed_uids`` (other users may pass through it, not list it). A directory that already
exists is used as it is, mode included: changing it is not the daemon's business (``--socket
~/d.sock`` once made a home directory 0700), and the socket's own mode and the uid check are
what keep others out. With ``allowed_uids``, an existing directory that others may not pass
through (no o+x) is logged as a warning: the allowed users cannot reach the socket. The
directories above the socket's must let those users pass too; the daemon leaves them as they
are. Having checked the directory through a descriptor opened without following a link, the
daemon binds and unlinks its socket through that descriptor (``/proc/self/fd/N/<name>``), so a
directory swapped in after the check is never used.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable, Collection

from offloadd.config import Config, DaemonConfig
from offloadd.daemon.connection import MAX_FDS, Connection, close_all, fds_of
from offloadd.daemon.handlers import Handlers
from offloadd.daemon.scheduler import Scheduler
from offloadd.daemon.session import SessionError
from offloadd.daemon.status import Status
from offloadd.io.buffers import ALIGN
from offloadd.io.engine_choice import open_host_engine
from offloadd.io.files import SlotFile, default_offload_dir
from offloadd.io.request import Engine
from offloadd.wire import protocol as proto
from offloadd.wire.address import socket_path
from offloadd.wire.checksum import checksum_function
from offloadd.wire.trust import open_socket_dir, own_uid, peer_credentials

__all__ = ["Server", "make_engine", "serve", "socket_modes"]

_KINDS = {stat.S_IFREG: "regular file", stat.S_IFDIR: "directory", stat.S_IFLNK: "symbolic link"}

log = logging.getLogger("offloadd.daemon")


def make_engine(config: DaemonConfig) -> Engine:
    """The daemon's I/O engine, chosen as the embedded one is (native where it built).

    The choice and its reason are logged by ``open_host_engine``, once."""
    engine, _choice = open_host_engine(Config(io_threads=config.io_threads))
    return engine


class Server:
    """The daemon: its listening socket, its connections, and the parts that answer them."""

    def __init__(self, config: DaemonConfig, made_socket_dir: str | None = None) -> None:
        """``made_socket_dir``: the socket's directory, when ``offloadd serve --socket`` has just
        created it (see [socket modes])."""
        self.config = config
        self.socket_path = socket_path(config.socket)  # see [the default socket]
        self._made_dir = made_socket_dir
        self._dir_fd = -1  # the socket's directory (see [socket modes])
        self.dirs = list(config.dirs) or [default_offload_dir()]
        for d in self.dirs:  # the same checks as the client's ssd_dirs, before binding
            SlotFile(d, ALIGN, config.direct_io).close()
        checksum = checksum_function(config.checksum)
        self.engine = make_engine(config)
        self.loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        self.conns: set[Connection] = set()
        self._stopping = asyncio.Event()
        self._listener: socket.socket | None = None
        self.status = Status(
            self.dirs,
            self.loop,
            socket_path=self.socket_path,
            engine=lambda: getattr(self.engine, "name", type(self.engine).__name__),
            checksum=config.checksum,
            sessions=lambda: self.handlers.sessions.values(),
            connections=lambda: len(self.conns),
            queue=lambda: self.scheduler.waiting(),
        )
        self.handlers = Handlers(config, self.dirs, self.status, stop=self.stop, drop=self.drop)
        self.scheduler = self.handlers.scheduler = Scheduler(
            self.engine, 2 * config.io_threads, checksum, self.loop, self.handlers
        )

    # -- lifecycle -------------------------------------------------------------------------

    def listen(self) -> None:
        path = self.socket_path
        directory = os.path.dirname(path) or "."
        name = os.path.basename(path)
        dir_mode, sock_mode = socket_modes(self.config.allowed_uids)
        made = self._make_socket_dir(directory)
        me = own_uid()  # see trust [who trusts whom]: the clients' rule, this uid alone trusted
        try:
            fd, st = open_socket_dir(directory, {me}, f"uid {me} (this daemon's)")
        except ValueError as e:
            raise ValueError(f"socket: {e}") from None
        self._dir_fd = fd
        if made:
            os.fchmod(fd, dir_mode)
        elif self.config.allowed_uids and not st.st_mode & stat.S_IXOTH:
            log.warning(
                "allowed_uids cannot reach the socket %s: its directory %r (mode %04o) lets no "
                "other user pass through (o+x); the daemon leaves an existing directory as it "
                "is: chmod o+x it, or name a socket directory for the daemon to create",
                path,
                directory,
                stat.S_IMODE(st.st_mode),
            )
        where = f"/proc/self/fd/{fd}/{name}"  # see [socket modes]: through the checked directory
        try:
            there = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(there.st_mode):  # never remove what is not a socket
                raise ValueError(
                    f"socket: {path!r} exists and is not a socket (a "
                    f"{_KINDS.get(stat.S_IFMT(there.st_mode), 'file')}); name a path that does "
                    "not exist, or the socket of a daemon that was stopped"
                )
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(where)
            except OSError:
                os.unlink(name, dir_fd=fd)  # left by a daemon that was killed
            else:
                raise ValueError(f"socket: another daemon is serving {path!r}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(where)
        finally:
            os.umask(old)
        os.chmod(where, sock_mode)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.loop.add_reader(sock.fileno(), self._accept)
        log.info(
            "serving %s (mode %04o, in a directory of mode %04o) as pid %d, dirs %s",
            path,
            sock_mode,
            stat.S_IMODE(os.fstat(fd).st_mode),
            os.getpid(),
            ", ".join(self.dirs),
        )

    def _make_socket_dir(self, directory: str) -> bool:
        """Create the socket's directory if it is missing (those above it as ``mkdir -p`` does,
        with the umask's mode); whether this daemon created it, here or in ``offloadd serve``
        (see [socket modes])."""
        made = self._made_dir
        if made is not None and os.path.abspath(made) == os.path.abspath(directory):
            return True
        try:
            os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
            os.mkdir(directory, 0o700)
        except FileExistsError:
            return False  # a link among them, too: open_socket_dir refuses it
        except OSError as e:
            raise ValueError(f"socket: cannot create directory {directory!r}: {e}") from None
        return True

    async def run(self) -> None:
        self.listen()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stop)
        self.status.start()
        await self._stopping.wait()
        await self.shutdown()

    def stop(self) -> None:
        self._stopping.set()

    async def shutdown(self) -> None:
        log.info("stopping")
        self.status.stop()
        if self._listener is not None:
            self.loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.basename(self.socket_path), dir_fd=self._dir_fd)
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        for conn in list(self.conns):
            self.drop(conn, "daemon stopping", error=False)
        sessions = self.handlers.sessions  # see handlers [a session ends after its I/O]
        while any(s.inflight for s in sessions.values()):
            await asyncio.sleep(0.01)
        await self.loop.run_in_executor(None, self.engine.close)
        for s in list(sessions.values()):
            self.handlers.finish_session(s)

    # -- connections -----------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.error("accept failed: %s", e)
                return
            pid, uid, _gid = peer_credentials(sock)
            if uid != own_uid() and uid not in self.config.allowed_uids:
                log.error("refused a connection from uid %d (pid %d): not allowed", uid, pid)
                self.status.totals["refused_connections"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = Connection(sock, uid, pid, loop=self.loop, drop=self.drop)
            self.conns.add(conn)
            self.loop.add_reader(sock.fileno(), self._readable, conn)

    def _readable(self, conn: Connection) -> None:
        try:
            data, anc, _flags, _ = conn.sock.recvmsg(
                65536, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.drop(conn, f"receive failed: {e}")
            return
        fds = fds_of(anc)
        if not data:
            close_all(fds)
            self.drop(conn, "client closed the connection", error=False)
            return
        conn.inbuf += data
        try:
            frames = proto.split_frames(conn.inbuf, proto.MAX_FRAME)
            if fds and not (len(frames) == 1 and frames[0][:1] == bytes([proto.Msg.OPEN])):
                raise proto.ProtocolError("descriptors sent with a message other than OPEN")
            for i, body in enumerate(frames):
                if conn.closed:
                    break
                self.handlers.handle(conn, proto.decode_request(body), fds if i == 0 else [])
                close_all(fds)  # any that OPEN did not take
        except (proto.ProtocolError, SessionError) as e:
            self.drop(conn, f"protocol error: {e}")
        finally:
            close_all(fds)

    def drop(self, conn: Connection, why: str, *, error: bool = True) -> None:
        """Close a connection, and end its session (see handlers [a session ends after its I/O])."""
        if conn.closed:
            return
        conn.closed = True
        who = f"pid {conn.pid} {conn.identity!r}"
        if error:
            log.error("dropping connection of %s: %s", who, why)
            self.status.totals["dropped_connections"] += 1
            self.status.error(f"{who}: {why}")
        else:
            log.info("connection of %s closed: %s", who, why)
        fd = conn.sock.fileno()
        self.loop.remove_reader(fd)
        if conn.writing:
            self.loop.remove_writer(fd)
        conn.sock.close()
        conn.discard()
        self.conns.discard(conn)
        if conn.session is not None:
            self.handlers.end_session(conn.session)


def socket_modes(allowed_uids: Collection[int]) -> tuple[int, int]:
    """The modes of the socket's directory and of the socket (see [socket modes])."""
    return (0o711, 0o666) if allowed_uids else (0o700, 0o600)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        log.warning(
            "uvloop is not installed; using asyncio's default event loop (uvloop is a "
            "dependency of offloadd: pip install uvloop)"
        )
        return asyncio.new_event_loop
    log.info("event loop: uvloop %s", uvloop.__version__)
    return uvloop.new_event_loop


def serve(config: DaemonConfig, made_socket_dir: str | None = None) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT or ``offloadd stop``.
    ``made_socket_dir``: see :class:`Server`."""

    async def main() -> None:
        server = Server(config, made_socket_dir)
        metrics = None
        if config.metrics_port:
            from offloadd.daemon.metrics import start_metrics

            metrics = start_metrics(server.status, config.metrics_port)
        try:
            await server.run()
        finally:
            if metrics is not None:
                metrics.shutdown()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())
    log.info("stopped")
    return 0
