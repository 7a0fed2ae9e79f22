"""Wire messages, one module per ZeroMQ channel; see :mod:`yutu.protocol.codec`."""
