package report

// Capacity is a kettle capacity run: the fleet stepped up until the SLO
// broke. The page shows the steps as a chart and the breaking step (or the
// last one) in full.
type Capacity struct {
	Command      string  `json:"command"`
	SLOP99Ms     float64 `json:"slo_p99_ms"`
	MaxErrorRate float64 `json:"max_error_rate"`
	// Holds is the largest step that met the SLO (0: none did).
	Holds int `json:"holds"`
	// BreaksAt is the first step that did not (0: none broke up to the max).
	BreaksAt int    `json:"breaks_at,omitempty"`
	Line     string `json:"line"` // what kettle capacity printed
	Steps    []Step `json:"steps"`
}

// Step is one fleet size, measured after its ramp.
type Step struct {
	Kettles     int     `json:"kettles"`
	OfferedPerS float64 `json:"offered_per_s"`
	DonePerS    float64 `json:"completed_per_s"`
	P50Ms       float64 `json:"p50_ms"`
	P99Ms       float64 `json:"p99_ms"` // worst endpoint, steady state
	ErrorRate   float64 `json:"error_rate"`
	MaxLagMs    float64 `json:"max_lag_ms"`
	Held        bool    `json:"held"`
	Why         string  `json:"why,omitempty"` // why it broke
	Verdict     Verdict `json:"verdict"`
	Results     string  `json:"results,omitempty"` // its results.json
}
