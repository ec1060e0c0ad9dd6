"""Planning: a Job (the traced step, mesh, devices, hardware, options, deadline, donation) in,
the Plan to run out. `driver` is the one entry (shardplan.api, shardplan.cluster and the CLI
call it); below it `select` judges a searched plan as compiled, the candidate makers
(`intra_op`: one program by the ILP; `remat`: the rematerialized step; `pipelines`,
`spmd_pipeline`: the SPMD and MPMD pipelines; `expert_plans`: the hand-written plans) return
Plans, `compiled` compiles and prices one program, `depth` prices a deep step from shallow
copies, and `job` holds the Job. Each imports only those listed after it (pyproject's
import-linter contract "planning")."""
