"""Kafka I/O shared by the edge, the workers and the streams: an asyncio-friendly producer of events,
a consumer thread, and dead-lettering. Depends on ``schemas`` only."""
