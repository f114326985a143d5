# offloadd daemon: one I/O service per node, shared by every training rank on it.
#
#   docker build -t offloadd .
#   mkdir -p -m 0700 /run/user/$(id -u)/offloadd   # the socket's directory: yours, 0700
#   docker run -d --name offloadd --user "$(id -u):$(id -g)" \
#       -v /run/user/$(id -u)/offloadd:/run/offloadd \
#       -v /mnt/nvme0/offloadd:/nvme0 -v /mnt/nvme1/offloadd:/nvme1 \
#       -e OFFLOADD_DAEMON_QUOTA_BYTES=64GiB \
#       offloadd --dir /nvme0 --dir /nvme1
#   # ranks on the host: OFFLOADD_DAEMON_SOCKET=/run/user/$(id -u)/offloadd/daemon.sock
#
# Settings: the [daemon] table of /etc/offloadd.toml (configs/daemon.toml), then OFFLOADD_DAEMON_*
# variables (docker run -e), then the options given after the image name.
#
# Run it as the training jobs' user (--user): the daemon accepts only its own uid (SO_PEERCRED)
# unless allowed_uids says otherwise (whose clients then set trusted_uids to this user's uid).
# The socket directory (first volume) must be that user's, not writable by group or others and
# not a symbolic link; it exists (a volume), so the daemon leaves its mode as it is: make it
# 0700, or 0711 for allowed_uids to reach the socket (0600, or 0666 with allowed_uids). Ranks
# receive their shared memory and file descriptors over the socket, so no --ipc or /dev/shm
# sharing is needed. The I/O engine is a thread pool (no io_uring, which Docker's default seccomp
# profile blocks).
FROM python:3.11-slim

# The daemon needs torch only as a host-memory library: the CPU wheel is enough.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# Everything `pip install .` builds from (setup.py, offloadd_boot.py and csrc/ too: without them
# the wheel lacks the start-up hook and the native engine; with no compiler in this image, the
# native engine is skipped and the daemon logs that it runs the Python engine).
COPY pyproject.toml setup.py offloadd_boot.py README.md LICENSE /src/
COPY offloadd /src/offloadd
COPY csrc /src/csrc
COPY configs /src/configs
# A plain install serves with the defaults (uvloop and xxhash are dependencies of offloadd). The
# daemon extra adds prometheus-client for --metrics-port, which listens on 127.0.0.1: reachable
# from the host only with --network host.
RUN pip install --no-cache-dir '/src[daemon]' && cp /src/configs/daemon.toml /etc/offloadd.toml \
    && rm -rf /src

VOLUME ["/run/offloadd"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["offloadd", "serve", "--config", "/etc/offloadd.toml", "--socket", "/run/offloadd/daemon.sock"]
CMD ["--dir", "/nvme0"]
