"""Motor: control plane and PD router for disaggregated LLM serving."""
