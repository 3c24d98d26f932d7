"""fedpar.security: certificates, TLS credentials, peer identity and admission (shared by server and client)."""
