"""Helpers shared by the test tiers: servers, stores, fault proxies, the unit tier's guard."""
