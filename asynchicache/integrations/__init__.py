"""Our tiers under other engines. Integrations sit at the server's level: they may
import engine, cache and storage; nothing in the package imports them."""
