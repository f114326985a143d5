"""What the daemon and its clients share: the wire format, the chunk checksums, whom to trust.

``protocol`` (the frames of a conversation), ``checksum`` (per-chunk checksums), ``address``
(where the node's daemon listens by default) and ``trust`` (which uids a client or the daemon
accepts, and the socket directory's checks). Standard
library only: the server (:mod:`offloadd.daemon`) and the client (:mod:`offloadd.backend`) both
import it, and neither imports the other.
"""

__all__: list[str] = []
