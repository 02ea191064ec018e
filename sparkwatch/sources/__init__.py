"""Read-only adapters. Each takes the root it reads from, so tests run the real code on fixture trees."""
