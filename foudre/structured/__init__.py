"""Structured output: grammars (JSON schema, regex, choice, EBNF) compiled against the
vocabulary with xgrammar, a matcher per request, and the token masks applied to logits
(``grammar``)."""
