//go:build race

package mqttapi_test

const raceEnabled = true
