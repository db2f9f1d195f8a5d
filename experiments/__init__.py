"""The lab: the experiments behind the project's results, their evidence and their pages (README.md here); the
library (topr_trl) never imports it."""
