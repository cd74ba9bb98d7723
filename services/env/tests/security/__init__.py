"""The security suite: attacks on the isolation guarantees, each kept as a test."""
