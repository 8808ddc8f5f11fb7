"""server.guards."""
