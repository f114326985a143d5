"""What the tests share: helpers, the daemon in a subprocess, environment runs, the op corpus
harness, memsave's cases; clients/ and ranks/ hold the scripts the tests launch."""
