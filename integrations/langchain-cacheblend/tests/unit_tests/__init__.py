"""Tests of langchain-cacheblend (a package, so this conftest never shadows the root tests' `conftest`)."""
