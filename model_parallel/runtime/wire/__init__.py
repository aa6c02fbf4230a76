"""What crosses between ranks: point-to-point messages, their header, the checks and heartbeats beside them, migration."""
